"""The typed schema: the one source of truth for every option.

Each option is one dataclass field whose ``help`` metadata is its one-line docstring. Its Megatron flag
(``--tensor-model-parallel-size``) and Hydra key (``parallel.tensor_model_parallel_size``) are derived from the field
by :mod:`megalite.config.flags`; cross-field rules live in :mod:`megalite.config.validate`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import typing
from dataclasses import dataclass
from typing import Any, Optional


class ConfigError(ValueError):
    """A bad option value or combination; reported as one line on every rank, exit code 2."""


# The values of --tokenizer-type, each the name of a tokenizer class in megalite.data.tokenizer (which checks that
# every one of them has its class): add a name here and its class there.
TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer")


# What a model option is to the trained weights (its ``role``; see ModelConfig).
MODEL, NUMERICS_NEUTRAL, RUN = "model", "numerics-neutral", "run"


def option(default, help: str, **kwargs):
    """A dataclass field with its one-line description (shown by ``--help``); a model option may give its ``role``."""
    if kwargs.get("role", MODEL) not in (MODEL, NUMERICS_NEUTRAL, RUN):
        raise ValueError(f"unknown role {kwargs['role']!r}")
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


@dataclass
class ModelConfig:
    """The model's options, each with a role (:data:`MODEL_DEFINING` names the first kind for every reader):
    ``model`` (the default, so an option added later counts) decides the function the weights compute: a resume must
    match it, --use-checkpoint-args takes it, a Hugging Face export maps it. ``numerics-neutral``: only how the same
    numbers are computed (recompute replays dropout; FP8 parameter gathering moves the same FP8 values; grouped GEMM
    and the token dispatcher sum the same products, at most in another order). ``run``: how the model trains, not what
    its weights compute: dropout, initialization, sample length, the FP8 recipe (the bf16 weights' products rounded
    while training), the vocabulary's padding (stored unpadded), the balancing losses, the expert bias's rate, and
    token dropping (a training budget: Switch Transformer evaluates at other capacities; Hugging Face drops none)."""
    num_layers: int = option(4, "Number of transformer layers.")
    hidden_size: int = option(128, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = option(None, "MLP hidden size; default 4 x hidden size.")
    num_attention_heads: int = option(4, "Number of attention heads.")
    seq_length: int = option(64, "Tokens per training sample.", role=RUN)
    max_position_embeddings: Optional[int] = option(None, "Size of the position table; default seq length.")
    vocab_size: int = option(1000, "Vocabulary size (of the tokenizer, or of the mock data).")
    make_vocab_size_divisible_by: int = option(
        128, "Pad the vocabulary to a multiple of this times the tensor-parallel size.", role=RUN)
    init_method_std: float = option(0.02, "Std of the normal initialization of weights.", role=RUN)
    hidden_dropout: float = option(0.1, "Dropout after attention/MLP outputs and on embeddings.", role=RUN)
    attention_dropout: float = option(0.1, "Dropout on attention probabilities.", role=RUN)
    layernorm_epsilon: float = option(1e-5, "Epsilon of the LayerNorms.")
    apply_layernorm_1p: bool = option(
        False, "Zero-centred norm weights: LayerNorm and RMSNorm scale by (1 + weight), the weight starting at 0 "
               "(Megatron's zero-centred gamma; Gemma's RMSNorm).")
    untie_embeddings_and_output_weights: bool = option(
        False, "Give the output layer its own weight instead of reusing the word embedding.")
    position_embedding_type: str = option(
        "learned_absolute", "learned_absolute (a learned position table added to the embeddings), rope (rotary "
                            "embeddings applied to queries and keys in every layer, rotate-half convention) or none "
                            "(no position information: causal attention alone, 'NoPE').")
    no_position_embedding: bool = option(
        False, "No learned position table (Megatron's legacy flag): turns learned_absolute into none; with rope, which "
               "has no table, it changes nothing.")
    rotary_base: int = option(10000, "With rope: base of the rotary frequencies (Llama 2: 10000, Llama 3: 500000).")
    rotary_percent: float = option(
        1.0, "With rope: the fraction of each head's channels that is rotated (the first int(head dim x this), whose "
             "frequencies are base^(-2i/that)); the other channels pass unrotated (GPT-NeoX, StableLM, Phi).")
    kv_channels: Optional[int] = option(
        None, "Head dimension of queries, keys and values; default hidden size / attention heads (Qwen3 and Gemma use "
              "another: the attention projections are then heads x this wide).")
    use_rope_scaling: bool = option(
        False, "With rope: scale the rotary frequencies for a context longer than the one pretrained at, as "
               "--rope-scaling-type says (by default Llama 3.1's scaling, the meaning of Megatron's flag).")
    rope_scaling_type: str = option(
        "llama3", "With --use-rope-scaling, Hugging Face's rope_type: llama3 (Llama 3.1: frequencies whose "
                  "wavelength exceeds the original context / the low-frequency factor are divided by "
                  "--rope-scaling-factor, those below it / the high-frequency factor kept, those between "
                  "interpolated smoothly), linear (every frequency divided by the factor: positions / factor, "
                  "Megatron's --rotary-seq-len-interpolation-factor) or yarn (YaRN: frequencies making more than "
                  "--beta-fast rotations over the original context kept, fewer than --beta-slow divided by the "
                  "factor, a linear ramp between; cos and sin multiplied by the attention factor). Dynamic NTK "
                  "scaling, which changes with the sequence length, is not supported.")
    rope_scaling_factor: float = option(
        8.0, "With --use-rope-scaling: the context extension factor, divisor of the scaled frequencies (Llama 3.1: "
             "8, Llama 3.2: 32).")
    rope_scaling_low_freq_factor: float = option(1.0, "With llama3 rope scaling: the low-frequency factor (Llama 3: "
                                                      "1).")
    rope_scaling_high_freq_factor: float = option(
        4.0, "With llama3 rope scaling: the high-frequency factor (Llama 3: 4).")
    rope_scaling_original_max_position_embeddings: int = option(
        8192, "With llama3 or yarn rope scaling: the context length the model was pretrained at before scaling "
              "(Llama 3: 8192).")
    beta_fast: float = option(32.0, "With yarn rope scaling: frequencies making more rotations than this over the "
                                    "original context are kept (Hugging Face's and Megatron's beta_fast).")
    beta_slow: float = option(1.0, "With yarn rope scaling: frequencies making fewer rotations than this over the "
                                   "original context are divided by the factor (beta_slow).")
    mscale: float = option(
        1.0, "With yarn rope scaling and --mscale-all-dim: the attention factor is (0.1 mscale ln factor + 1) / "
             "(0.1 mscale_all_dim ln factor + 1) (DeepSeek's; Megatron's flag); without, 0.1 ln factor + 1.")
    mscale_all_dim: float = option(0.0, "With yarn rope scaling: see --mscale (0: unused).")
    yarn_unrounded_correction_range: bool = option(
        False, "With yarn rope scaling: keep the fractional channel bounds of the ramp between kept and divided "
               "frequencies (Hugging Face's truncate: false, gpt-oss; Megatron's yarn_correction_range_round_to_int "
               "false); default rounded outwards.")
    rope_scaling_attention_factor: Optional[float] = option(
        None, "With yarn rope scaling: the factor cos and sin are multiplied by (Hugging Face's attention_factor); "
              "default derived from the factor, --mscale and --mscale-all-dim.")
    normalization: str = option("LayerNorm", "LayerNorm or RMSNorm (a learned scale only: no bias, no centering).")
    sandwich_norm: bool = option(
        False, "Also normalize the attention's and the MLP's outputs before their residual adds "
               "(x + Norm(Attn(Norm(x))), x + Norm(MLP(Norm(x)))): Gemma 2/3's post_attention_layernorm and "
               "post_feedforward_layernorm.")
    scale_embeddings: bool = option(
        False, "Multiply the word embeddings by sqrt(hidden size), the factor first rounded to the model's dtype "
               "(Gemma's embedding normalizer, as transformers computes it); the tied output layer uses the unscaled "
               "weight.")
    swiglu: bool = option(
        False, "SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up each of --ffn-hidden-size (Llama's MLP).")
    quick_geglu: bool = option(
        False, "Gated MLP with quick GeLU: down(quick_gelu(gate(x)) * (up(x) + --glu-linear-offset)), quick_gelu(y) = "
               "y sigmoid(1.702 y) (Megatron's --quick-geglu; gpt-oss' experts with the offset 1 and "
               "--activation-func-clamp-value 7).")
    glu_linear_offset: float = option(
        0.0, "With a gated MLP (--swiglu or --quick-geglu): added to the linear (up) half before the product "
             "(Megatron's glu_linear_offset; gpt-oss: 1).")
    activation_func_clamp_value: Optional[float] = option(
        None, "With a gated MLP: the gate half clamped to at most this and the linear half to [-this, this] before "
              "the activation (Megatron's activation_func_clamp_value; gpt-oss: 7); default none.")
    gated_linear_unit: bool = option(
        False, "GeGLU MLP: down(gelu(gate(x)) * up(x)), gate and up each of --ffn-hidden-size; with --openai-gelu "
               "the tanh approximation (Gemma's gelu_pytorch_tanh). Megatron-core's gated_linear_unit with a GeLU; "
               "--swiglu is the gated MLP with SiLU.")
    openai_gelu: bool = option(
        False, "The GeLU (or GeGLU) MLP uses the tanh approximation of GeLU (OpenAI's GPT-2, Hugging Face gelu_new, "
               "Megatron's --openai-gelu) instead of the exact erf form.")
    group_query_attention: bool = option(
        False, "Grouped-query attention: the query heads share --num-query-groups key/value heads.")
    num_query_groups: int = option(1, "With --group-query-attention: number of key/value heads (1: multi-query).")
    disable_bias_linear: bool = option(
        False, "No biases in the attention and MLP linear layers (nor in the MoE router and experts: with biases "
               "the router's logits have one per expert, as Megatron's).")
    add_qkv_bias: bool = option(
        False, "A bias on the query/key/value projection even with --disable-bias-linear (Qwen2's attention).")
    qk_layernorm: bool = option(
        False, "Normalize each attention head's query and key (the configured norm over the head dimension, before "
               "rotary embeddings), as Qwen3 and OLMo 2 do.")
    softmax_scale: Optional[float] = option(
        None, "The factor of the attention scores q k^T before the softmax; default 1/sqrt(head dim) (Megatron-core's "
              "softmax_scale; Gemma 3: query_pre_attn_scalar^-0.5).")
    window_size: Optional[str] = option(
        None, "Sliding-window attention, Megatron's 'LEFT,RIGHT' (or '(LEFT,RIGHT)'), e.g. 4096,0: each query "
              "attends to itself and the LEFT tokens before it (Hugging Face's sliding_window is LEFT + 1); RIGHT "
              "must be 0 (causal). Default: no window, every earlier token.")
    window_attn_skip_freq: Optional[str] = option(
        None, "With --window-size, which layers attend globally instead: an integer N (layers N, 2N, ... counted "
              "from 1) or a 0/1 pattern with one entry per layer, 1 windowed and 0 global, e.g. '[1,1,1,0]*2' "
              "(Megatron's syntax). Default: every layer windowed.")
    local_rotary_base: Optional[int] = option(
        None, "With rope and --window-size: the rotary base of the windowed layers, whose rotary embeddings are then "
              "never rope-scaled (Gemma 3's rope_local_base_freq); the global layers keep --rotary-base and the rope "
              "scaling. Default: every layer as the global ones.")
    softmax_type: str = option(
        "vanilla", "The attention softmax (Megatron's --softmax-type): vanilla; off-by-one, a zero logit beside each "
                   "row's scores (softmax with 1 added to its denominator); learnable, one learned logit per head "
                   "there instead (gpt-oss' attention sinks). A sink takes probability and contributes no value.")
    multi_latent_attention: bool = option(
        False, "Multi-latent attention (DeepSeek-V2/V3, megalite.model.latent_attention): keys and values "
               "up-projected per head from a shared compressed latent of --kv-lora-rank channels, plus one rotary key "
               "of --qk-pos-emb-head-dim channels shared by every head; the KV cache keeps the latent.")
    q_lora_rank: Optional[int] = option(
        None, "With --multi-latent-attention: rank of the queries' low-rank down-projection (DeepSeek-V3: 1536); "
              "default none, one projection from the hidden size (DeepSeek-V2-Lite).")
    kv_lora_rank: int = option(32, "With --multi-latent-attention: channels of the compressed key/value latent "
                                   "(DeepSeek-V3: 512).")
    qk_head_dim: int = option(128, "With --multi-latent-attention: each head's query/key channels without rotary "
                                   "embeddings (Hugging Face's qk_nope_head_dim).")
    qk_pos_emb_head_dim: int = option(64, "With --multi-latent-attention: each head's query/key channels with rotary "
                                          "embeddings (Hugging Face's qk_rope_head_dim), the key's shared by every "
                                          "head.")
    v_head_dim: int = option(128, "With --multi-latent-attention: each head's value channels.")
    recompute_granularity: Optional[str] = option(
        None, "Activation recompute: full (keep each recomputed group's input only, rerun it in backward) or "
              "selective (rerun only the attention core: softmax, dropout and the two attention products).",
        role=NUMERICS_NEUTRAL)
    recompute_method: Optional[str] = option(
        None, "With full recompute: uniform (every model chunk's layers in groups of --recompute-num-layers) or block "
              "(only the first --recompute-num-layers layers of each model chunk, one by one).", role=NUMERICS_NEUTRAL)
    recompute_num_layers: int = option(
        1, "With full recompute: layers per recomputed group (uniform) or recomputed layers per chunk (block).",
        role=NUMERICS_NEUTRAL)
    recompute_modules: Optional[str] = option(
        None, "With --recompute-granularity selective, the parts of every layer rerun in backward (Megatron's names): "
              "core_attn (the default: softmax, dropout, the attention products), mlp (a dense MLP), moe (an MoE "
              "layer, all-to-alls included), shared_experts, keeping their input; layernorm (both norms), moe_act "
              "(the experts' activation), mla_up_proj (multi-latent attention's up-projections and rope), keeping "
              "nothing: their output is freed once used and recomputed when backward reaches its user.",
        nargs="+", metavar="MODULE", role=NUMERICS_NEUTRAL)
    fine_grained_activation_offloading: bool = option(
        False, "Move what the --offload-modules parts of every layer save for backward to host memory during the "
               "forward (megalite.tensor_parallel.offload: saved-tensor hooks; on a GPU pinned buffers and side "
               "streams, reloads one module ahead of the backward); the same steps, bit for bit.",
        role=NUMERICS_NEUTRAL)
    offload_modules: Optional[str] = option(
        None, "With --fine-grained-activation-offloading, the parts offloaded (Megatron's names): attn_norm and "
              "mlp_norm (the norms' inputs and statistics), core_attn (what the attention core keeps: queries, keys, "
              "values, the softmax), attn_proj (the output projection's input; needs core_attn, which keeps it "
              "too), expert_fc1 (the routed experts' input), moe_act (the experts' activation input).",
        nargs="+", metavar="MODULE", role=NUMERICS_NEUTRAL)
    fp8_format: Optional[str] = option(
        None, "FP8 matrix products in the attention and MLP linears (torch._scaled_mm; bf16 master weights, norms, "
              "softmax, embeddings and output layer): e4m3 (every operand e4m3) or hybrid (e4m3 forward, e5m2 "
              "gradients), Transformer Engine's names; needs --bf16.", role=RUN)
    fp8_recipe: str = option(
        "delayed", "With --fp8-format, how FP8 scales are chosen: tensorwise (the amax of each tensor now), delayed "
                   "(Transformer Engine's: from the amax history of earlier steps) or rowwise (per row of "
                   "activations and gradients, per column of weights, along each product's inner dimension).",
        role=RUN)
    fp8_margin: int = option(
        0, "With --fp8-format: scale FP8 values 2^margin below the format's largest value.", role=RUN)
    fp8_amax_history_len: int = option(
        1, "With --fp8-recipe delayed: steps of amax history kept per tensor.", role=RUN)
    fp8_amax_compute_algo: str = option(
        "most_recent", "With --fp8-recipe delayed: the amax a scale comes from, max (of the history) or most_recent.",
        role=RUN)
    fp8_param_gather: bool = option(
        False, "With --fp8-format and the distributed optimizer or ZeRO-3: all-gather the FP8 linears' weight shards "
               "as FP8 (1 byte an element, half of bf16's traffic) and multiply by them as gathered (recipes "
               "tensorwise and delayed); the same steps, bit for bit.", role=NUMERICS_NEUTRAL)
    # Mixture of experts (megalite.model.moe). Every moe_* option needs --num-experts.
    num_experts: Optional[int] = option(
        None, "Mixture of experts: routed experts per MoE layer (each an MLP of --moe-ffn-hidden-size); default: "
              "none, every layer has a dense MLP.")
    moe_ffn_hidden_size: Optional[int] = option(None, "Hidden size of each routed expert; default --ffn-hidden-size.")
    moe_router_topk: int = option(2, "Experts each token is routed to (k of top-k).")
    moe_layer_freq: str = option(
        "1", "Which layers are MoE layers: every k-th (an integer k: layer i when i % k == 0) or a 0/1 pattern with "
             "one entry per layer, e.g. '[0,1,1,1]' or '([0]+[1]*3)*2' (Megatron's syntax); the others keep a dense "
             "MLP.")
    moe_shared_expert_intermediate_size: Optional[int] = option(
        None, "Hidden size of the shared expert (an MLP every token goes through beside its routed experts).")
    moe_shared_expert_gate: bool = option(
        False, "Scale the shared expert's output by sigmoid(x w) of a learned vector w (Qwen2-MoE's gate).")
    moe_router_score_function: str = option(
        "softmax", "Router scores: softmax over the experts or sigmoid of each (DeepSeek-V3; the top-k weights are "
                   "then normalized to sum 1).")
    moe_router_pre_softmax: bool = option(
        False, "Softmax over all experts before choosing the top k, whose weights are then used as they are "
               "(Qwen2-MoE); by default the softmax runs over the k chosen logits (weights summing to 1, Mixtral).")
    moe_router_topk_scaling_factor: Optional[float] = option(
        None, "Multiply the routing weights by this factor (DeepSeek's routed scaling factor).")
    moe_router_num_groups: Optional[int] = option(
        None, "Group-limited routing (DeepSeek-V3): the experts, in order, form this many equal groups and each "
              "token's top k come from its --moe-router-group-topk best groups only; default none, every expert "
              "eligible.")
    moe_router_group_topk: Optional[int] = option(
        None, "With --moe-router-num-groups: the groups a token may use, those whose top --moe-router-topk / "
              "--moe-router-group-topk scores (with the expert bias, the biased scores) sum the highest.")
    moe_router_load_balancing_type: str = option(
        "aux_loss", "Load balancing: aux_loss (Switch Transformer's loss over each micro-batch), seq_aux_loss "
                    "(the same loss per sequence, averaged: DeepSeek-V2/V3) or none.", role=RUN)
    moe_aux_loss_coeff: float = option(0.0, "Coefficient of the load-balancing loss (0: not computed).", role=RUN)
    moe_z_loss_coeff: Optional[float] = option(
        None, "Coefficient of the router z-loss, mean of logsumexp(logits)^2 (ST-MoE); default none.", role=RUN)
    moe_router_enable_expert_bias: bool = option(
        False, "Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing the "
               "top k only, moved by --moe-router-bias-update-rate after every step towards equal load (needs "
               "--moe-router-score-function sigmoid).")
    moe_router_bias_update_rate: float = option(
        1e-3, "With --moe-router-enable-expert-bias: bias += rate x sign(mean load - expert's load) each step.",
        role=RUN)
    moe_expert_capacity_factor: Optional[float] = option(
        None, "Token dropping: each expert takes at most ceil(factor x tokens x k / experts) of a micro-batch's "
              "tokens (on each rank), the rest of its tokens are dropped; default none, dropless.", role=RUN)
    moe_token_drop_policy: str = option(
        "probs", "With a capacity factor, which tokens an expert keeps: probs (its highest-weight ones) or position "
                 "(the earliest in the micro-batch).", role=RUN)
    moe_token_dispatcher_type: str = option(
        "alltoall", "How tokens reach experts on other expert-parallel ranks: alltoall (each rank sends every token "
                    "only where its experts are, uneven all-to-alls) or allgather (every rank gathers all tokens "
                    "and keeps those of its experts; outputs are summed back by a reduce-scatter).",
        role=NUMERICS_NEUTRAL)
    moe_grouped_gemm: bool = option(
        False, "Run a rank's experts as one grouped matrix product (torch._grouped_mm where this torch and device "
               "offer it for the dtype and shapes) instead of a loop over experts.", role=NUMERICS_NEUTRAL)
    # Multi-token prediction (megalite.model.multi_token_prediction), DeepSeek-V3's.
    mtp_num_layers: Optional[int] = option(
        None, "Multi-token prediction (DeepSeek-V3's MTP): this many sequential modules after the last layer, module k "
              "predicting the token k + 1 places ahead from the previous depth's hidden states and the embedding of "
              "the token k places ahead (one transformer layer each, built like the last layer; the embedding and "
              "output layer shared with the model); on the last pipeline stage. Default: none.")
    mtp_loss_scaling_factor: float = option(
        0.1, "With --mtp-num-layers: the training loss adds this times the mean over the depths of each depth's "
             "cross-entropy (the logged loss stays the language-model loss; mtp_loss is logged beside it).", role=RUN)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP is gated (SwiGLU, quick GeGLU or GeGLU): its first linear is [gate; up], 2 x ffn wide."""
        return self.swiglu or self.quick_geglu or self.gated_linear_unit

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_size(self) -> int:
        """Width of the queries (and of the attention's output before its projection): heads x head dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def learned_positions(self) -> bool:
        return self.position_embedding_type == "learned_absolute" and not self.no_position_embedding

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rope rotates."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def query_groups(self) -> int:
        """Number of key/value heads: num_query_groups with grouped-query attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    def moe_layers(self) -> list[bool]:
        """Whether each layer (by global index) is an MoE layer: --moe-layer-freq as a k or a 0/1 pattern."""
        if self.num_experts is None:
            return [False] * self.num_layers
        from megalite.config.flags import FLAG   # noqa: PLC0415 - flags import this module

        return self._per_layer(FLAG.moe_layer_freq, self.moe_layer_freq, lambda i, k: i % k == 0,
                               ", e.g. [0,1,1,1] or ([0]+[1]*3)*2")

    def _per_layer(self, flag: str, value, every, example: str) -> list[bool]:
        """A per-layer switch given as an integer k (``every(i, k)`` for layer i) or a 0/1 pattern with one entry
        per layer (Megatron's list syntax, evaluated without eval)."""
        from megalite.config.flags import FLAG   # noqa: PLC0415 - flags import this module

        text = str(value).strip()
        if text.isdigit():
            k = int(text)
            if k < 1:
                raise ConfigError(f"{flag} must be >= 1, got {k}")
            return [every(i, k) for i in range(self.num_layers)]
        pattern = _layer_pattern(text)
        if pattern is None or any(v not in (0, 1) for v in pattern):
            raise ConfigError(f"{flag} {text!r} must be an integer or a list of 0/1{example}")
        if len(pattern) != self.num_layers:
            raise ConfigError(f"{flag} {text!r} has {len(pattern)} entries for {FLAG.num_layers} {self.num_layers}")
        return [v == 1 for v in pattern]

    def recomputed_modules(self) -> frozenset[str]:
        """--recompute-modules as a set (core_attn alone by default); empty unless the granularity is selective."""
        if self.recompute_granularity != "selective":
            return frozenset()
        return frozenset(multi_word_values(self.recompute_modules) if self.recompute_modules else ["core_attn"])

    def offloaded_modules(self) -> frozenset[str]:
        """--offload-modules as a set; empty without --fine-grained-activation-offloading."""
        if not self.fine_grained_activation_offloading or not self.offload_modules:
            return frozenset()
        return frozenset(multi_word_values(self.offload_modules))

    def attention_windows(self) -> list[Optional[int]]:
        """Each layer's (by global index) attention window: the tokens before a query it attends to besides itself,
        None for every earlier token (no --window-size, or a layer --window-attn-skip-freq makes global)."""
        from megalite.config.flags import FLAG   # noqa: PLC0415 - flags import this module

        if self.window_size is None:
            if self.window_attn_skip_freq is not None:
                raise ConfigError(f"{FLAG.window_attn_skip_freq} needs {FLAG.window_size}")
            return [None] * self.num_layers
        text = str(self.window_size).strip()   # also Megatron's stored tuple, (4096, 0)
        try:
            sides = [int(side) for side in text.strip("()").split(",")]
        except ValueError:
            sides = []
        if len(sides) != 2:
            raise ConfigError(f"{FLAG.window_size} {text!r} must be two integers LEFT,RIGHT, e.g. 4096,0")
        left, right = sides
        if left < 0 or right != 0:
            raise ConfigError(f"{FLAG.window_size} {text!r}: attention is causal, so it takes LEFT >= 0 tokens "
                              f"before each query and RIGHT 0 after it, e.g. {max(left, 0)},0")
        return [left if windowed else None for windowed in self._windowed_layers()]

    def _windowed_layers(self) -> list[bool]:
        """--window-attn-skip-freq per layer (Megatron's is_layer_window_attention, layers counted from 1)."""
        from megalite.config.flags import FLAG   # noqa: PLC0415 - flags import this module

        if self.window_attn_skip_freq is None:
            return [True] * self.num_layers
        return self._per_layer(FLAG.window_attn_skip_freq, self.window_attn_skip_freq, lambda i, n: (i + 1) % n != 0,
                               " (1: windowed), e.g. 4 or [1,1,1,0]*2")

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by x TP (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


# The ModelConfig fields whose role is "model" (see ModelConfig): the options that decide what the weights compute.
MODEL_DEFINING = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("role", MODEL) == MODEL)


def _layer_pattern(text: str) -> Optional[list]:
    """The list a Megatron layer pattern such as '([0]+[1]*3)*2' stands for: list literals of integers, + and *
    only (evaluated without eval); None if the text is anything else."""
    import ast   # noqa: PLC0415 - only for patterns

    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                return left * right
        raise ValueError(node)

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None
    return result if isinstance(result, list) else None


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = option(1, "Tensor-parallel size (ranks splitting each layer's matrices).")
    pipeline_model_parallel_size: int = option(1, "Pipeline-parallel size (ranks splitting the layer stack).")
    sequence_parallel: bool = option(
        False, "Split norms, dropout and the residual stream along the sequence over the tensor-parallel ranks "
               "(activation memory / TP there too; needs TP > 1).")
    context_parallel_size: int = option(
        1, "Context-parallel size CP: ranks splitting every sample's sequence, each holding seq / CP tokens of it "
           "(the same weights; gradients are reduced over data-parallel x context-parallel ranks).")
    cp_comm_type: str = option(
        "p2p", "With --context-parallel-size > 1, how attention sees the other ranks' tokens: p2p (ring attention: "
               "key/value blocks travel around the CP ranks, sequence cut into 2 x CP chunks for causal load "
               "balance), a2a (DeepSpeed-Ulysses: all-to-alls turn sequence shards into head shards around the "
               "attention core), allgather (keys and values gathered over CP, local queries only) or a2a+p2p "
               "(hierarchical: a2a inside groups of adjacent CP ranks, the ring across them; "
               "--hierarchical-context-parallel-sizes).")
    hierarchical_context_parallel_sizes: Optional[str] = option(
        None, "With --cp-comm-type a2a+p2p: A P, A adjacent CP ranks exchanging heads by all-to-all (inside a node) "
              "and P of those groups in a ring (across nodes); A x P = --context-parallel-size.",
        nargs="+", metavar="A2A P2P")
    expert_model_parallel_size: int = option(
        1, "Expert-parallel size EP: the data-parallel (x context-parallel) ranks are grouped EP at a time, each of "
           "a group holding 1/EP of every MoE layer's experts; expert gradients are summed over the DP x CP / EP "
           "ranks holding the same experts.")
    expert_tensor_parallel_size: Optional[int] = option(
        None, "Tensor-parallel size inside the routed experts: the tensor-parallel size (default: experts split like "
              "the dense MLP) or 1 (every tensor-parallel rank holds whole experts and computes them redundantly, "
              "with no tensor-parallel reduction of their outputs).")
    num_distributed_optimizer_instances: int = option(
        1, "HSDP: with the distributed optimizer (ZeRO-1/2) or --zero-stage 3, split the data-parallel x "
           "context-parallel ranks into this many groups of adjacent ranks (instances); optimizer states (and "
           "gradients, parameters per stage) are sharded inside each instance and replicated across them. Gradients "
           "are reduce-scattered inside an instance, then all-reduced across instances.")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "Layers per model chunk for the interleaved schedule (alternative to the next option).")
    num_virtual_stages_per_pipeline_rank: Optional[int] = option(
        None, "Model chunks per pipeline rank (V); V > 1 interleaves the schedule.")
    decoder_first_pipeline_num_layers: Optional[int] = option(
        None, "Transformer layers on the first pipeline rank (split over its V chunks); the ranks between the first "
              "and last share the rest evenly. Default: an even split.")
    decoder_last_pipeline_num_layers: Optional[int] = option(
        None, "Transformer layers on the last pipeline rank (split over its V chunks; it also holds the output "
              "layer and the loss). Default: an even split.")
    account_for_embedding_in_pipeline_split: bool = option(
        False, "Count the embedding as one layer of the even split: the first virtual stage holds one transformer "
               "layer fewer.")
    account_for_loss_in_pipeline_split: bool = option(
        False, "Count the output layer and loss as one layer of the even split: the last virtual stage holds one "
               "transformer layer fewer.")
    pipeline_model_parallel_layout: Optional[str] = option(
        None, "Every virtual stage's contents in order, Megatron's syntax: E embedding, t transformer layer, m "
              "multi-token-prediction layer, L loss, | between stages, (...)*n and x*n repeat; e.g. "
              "'Et|(tt|)*2,tL' (4 stages). Its stages / PP give V.")
    pipeline_schedule: str = option(
        "1f1b", "1f1b (interleaved when V > 1), zero-bubble (ZB-H1: each backward's weight gradients deferred to "
                "fill the bubble, at 1F1B's activation memory; interleaved when V > 1) or zbv (ZB-V: two chunks per "
                "rank placed in a V, chunk 0 down the ranks and chunk 1 back up; V defaults to 2).")

    def virtual_stages(self, num_layers: int) -> int:
        """V, the number of model chunks per pipeline rank (1 unless an interleaving option or a layout is set; 2 for
        zbv)."""
        if self.pipeline_model_parallel_layout is not None:
            from megalite.config.pipeline_split import parse_layout   # noqa: PLC0415 - a small parser, rarely used
            try:
                return max(1, len(parse_layout(self.pipeline_model_parallel_layout)) //
                           self.pipeline_model_parallel_size)
            except ValueError:
                pass   # pipeline_split says why
        if self.num_virtual_stages_per_pipeline_rank is not None:
            return self.num_virtual_stages_per_pipeline_rank
        if self.num_layers_per_virtual_pipeline_stage is not None:
            return num_layers // (self.num_layers_per_virtual_pipeline_stage * self.pipeline_model_parallel_size)
        return 2 if self.pipeline_schedule == "zbv" else 1

    def hierarchical_context_parallel(self) -> Optional[tuple[int, int]]:
        """--hierarchical-context-parallel-sizes as (a2a size, p2p size); None when not given (ConfigError: not two
        integers)."""
        if self.hierarchical_context_parallel_sizes is None:
            return None
        from megalite.config.flags import FLAG   # noqa: PLC0415 - flags import this module
        words = multi_word_values(str(self.hierarchical_context_parallel_sizes))
        if len(words) != 2 or not all(word.isdigit() and int(word) > 0 for word in words):
            raise ConfigError(f"{FLAG.hierarchical_context_parallel_sizes} takes two positive integers A2A P2P, got "
                              f"{self.hierarchical_context_parallel_sizes!r}")
        return int(words[0]), int(words[1])

    def pipeline_split(self, model: ModelConfig) -> Optional[tuple[int, ...]]:
        """``model``'s transformer layers per virtual stage (in virtual-stage order) from the uneven-pipeline options,
        or None for the even split (megalite.config.pipeline_split)."""
        num_layers, mtp_layers = model.num_layers, model.mtp_num_layers or 0
        from megalite.config import pipeline_split as split   # noqa: PLC0415 - it imports nothing of ours
        from megalite.config.flags import FLAG   # noqa: PLC0415 - flags import this module
        pp, v = self.pipeline_model_parallel_size, self.virtual_stages(num_layers)
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        embedding, loss = self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split
        try:
            if self.pipeline_model_parallel_layout is not None:
                flag = FLAG.pipeline_model_parallel_layout
                return split.layout_split(self.pipeline_model_parallel_layout, pp, num_layers, mtp_layers)
            if first is not None or last is not None:
                flag = f"{FLAG.decoder_first_pipeline_num_layers}/{FLAG.decoder_last_pipeline_num_layers}"
                return split.first_last_split(num_layers, pp, v, first, last)
            if embedding or loss:
                flag = f"{FLAG.account_for_embedding_in_pipeline_split}/{FLAG.account_for_loss_in_pipeline_split}"
                return split.accounted_split(num_layers, pp * v, embedding, loss)
        except ValueError as error:
            raise ConfigError(f"{flag}: {error}") from None
        return None


@dataclass
class OptimizerConfig:
    lr: float = option(3e-4, "Peak learning rate.")
    min_lr: float = option(0.0, "Learning rate at the end of the decay.")
    lr_decay_style: str = option("cosine", "Decay after warm-up: cosine, linear or constant.")
    lr_warmup_iters: int = option(0, "Iterations of linear warm-up from 0 to lr.")
    lr_decay_iters: Optional[int] = option(None, "Iteration at which the decay reaches min_lr; default train iters.")
    lr_warmup_samples: int = option(0, "With --train-samples: samples of linear warm-up from 0 to lr.")
    lr_decay_samples: Optional[int] = option(
        None, "With --train-samples: samples after which the decay reaches min_lr; default train samples.")
    lr_warmup_fraction: Optional[float] = option(
        None, "Warm up over this fraction of the decay (iterations or samples), instead of --lr-warmup-iters or "
              "--lr-warmup-samples.")
    decoupled_lr: Optional[float] = option(
        None, "Peak learning rate of the word embedding and the output layer (same warm-up and decay); default lr.")
    decoupled_min_lr: Optional[float] = option(
        None, "With --decoupled-lr: the word embedding's and output layer's final learning rate; default min lr.")
    weight_decay: float = option(0.01, "AdamW weight decay (not applied to biases and norm weights).")
    clip_grad: float = option(1.0, "Clip gradients to this global L2 norm; 0 disables clipping.")
    adam_beta1: float = option(0.9, "Adam beta1.")
    adam_beta2: float = option(0.999, "Adam beta2.")
    adam_eps: float = option(1e-8, "Adam epsilon.")
    optimizer: str = option(
        "adam", "adam (AdamW for every parameter) or muon: Muon (momentum orthogonalized by Newton-Schulz) for the "
                "2-D hidden weights (each routed expert's on its own), AdamW for the embeddings, the output layer, "
                "norms and biases.")
    muon_momentum: float = option(0.95, "With --optimizer muon: the momentum of the matrices' update.")
    muon_use_nesterov: bool = option(False, "With --optimizer muon: Nesterov momentum.")
    muon_num_ns_steps: int = option(5, "With --optimizer muon: Newton-Schulz iterations per update.")
    muon_scale_mode: str = option(
        "spectral", "With --optimizer muon: the orthogonalized update of an m x n matrix is multiplied by "
                    "sqrt(max(m, n)) (spectral), sqrt(max(1, m/n)) (shape_scaling) or sqrt(m/n) (unit_rms_norm), "
                    "then by --muon-extra-scale-factor.")
    muon_extra_scale_factor: float = option(
        0.2, "With --optimizer muon: a further factor on the update; 0.2 with spectral gives the update AdamW's RMS "
             "(Moonlight), so AdamW's learning rate and weight decay carry over (Megatron's default is 1.0).")
    muon_tp_mode: str = option(
        "duplicated", "With --optimizer muon and tensor parallelism: duplicated (each TP rank gathers the whole "
                      "matrix and orthogonalizes it), distributed (Newton-Schulz on the shards, its Gram matrices "
                      "summed over TP) or blockwise (each shard orthogonalized on its own: the result depends on TP; "
                      "Megatron's default).")
    muon_no_split_qkv: bool = option(
        False, "With --optimizer muon: orthogonalize the fused query/key/value weight as one matrix, not as three.")
    use_distributed_optimizer: bool = option(
        False, "Shard fp32 main parameters and Adam states over data-parallel ranks (ZeRO-1; see zero_stage).")
    zero_stage: int = option(
        1, "ZeRO stage. With --use-distributed-optimizer: 1 shards optimizer states, 2 also keeps only this rank's "
           "gradient shard. 3 (on its own) shards parameters, gradients and optimizer states over the data-parallel "
           "ranks with PyTorch FSDP2, gathering each layer's parameters just for its forward and backward.")
    overlap_grad_reduce: bool = option(
        False, "Start each gradient bucket's reduction as soon as backward has produced all of its gradients.")
    overlap_param_gather: bool = option(
        False, "With the distributed optimizer: gather updated parameters asynchronously, waiting only when the "
               "next forward needs them.")
    grad_reduce_in_bf16: bool = option(
        False, "With --bf16: accumulate and reduce gradients in bfloat16 (half the gradient memory and traffic); the "
               "optimizer still steps fp32 main parameters.")
    no_gradient_accumulation_fusion: bool = option(
        False, "Megatron's switch off of gradient-accumulation fusion: by default the column- and row-parallel "
               "linears add their weight gradient straight into the main-gradient buffer in their backward (no "
               "param.grad, no hook), except under ZeRO-2 and ZeRO-3, which keep no such buffer.")
    ddp_bucket_size: Optional[int] = option(
        None, "Elements per gradient-reduction bucket; default max(40M, 1M x data-parallel size).")
    zero3_prefetch_bucket_size: Optional[int] = option(
        None, "With --zero-stage 3: parameter elements FSDP2 may gather ahead of use: each layer prefetches the next "
              "ones (in backward the previous ones) whose elements, of this rank's TP slice, fit in this, at least "
              "one; default: one layer ahead, FSDP2's own (DeepSpeed's stage3_prefetch_bucket_size).")
    optimizer_cpu_offload: bool = option(
        False, "Keep fp32 main parameters and Adam states on the CPU and step them there (fused C++ Adam).")
    offload_params: bool = option(
        False, "With --zero-stage 3 and --optimizer-cpu-offload: keep the parameter and gradient shards on the CPU "
               "too, copying each layer's shard to the device only to gather it (FSDP2's CPUOffloadPolicy).")
    loss_scale: Optional[float] = option(None, "With --fp16: a constant loss scale instead of dynamic scaling.")
    initial_loss_scale: float = option(2.0**32, "With --fp16: the starting dynamic loss scale.")
    min_loss_scale: float = option(1.0, "With --fp16: the dynamic loss scale never goes below this.")
    loss_scale_window: int = option(1000, "With --fp16: steps without overflow before the scale doubles.")
    hysteresis: int = option(2, "With --fp16: overflowing steps tolerated before the scale halves.")

    @property
    def zero_level(self) -> int:
        """What is sharded over the data-parallel ranks: 0 nothing (plain data parallelism), 1 optimizer states, 2
        gradients too (both with the distributed optimizer), 3 parameters too (FSDP2, without it)."""
        if self.zero_stage == 3:
            return 3
        return self.zero_stage if self.use_distributed_optimizer else 0

    @staticmethod
    def zero_settings(level: int) -> dict[str, object]:
        """The two options that select ZeRO ``level`` (the inverse of :attr:`zero_level`)."""
        return {"use_distributed_optimizer": level in (1, 2), "zero_stage": max(level, 1)}


def multi_word_values(text: str) -> list[str]:
    """The words of a multi-word option (Megatron's nargs="+"), split as a shell would: a word in quotes may hold
    spaces (``'my corpus/text' other``); a stray quote (``John's``) leaves plain whitespace splitting."""
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


@dataclass
class DataConfig:
    mock_data: bool = option(False, "Train on deterministic synthetic sequences (no data files needed).")
    data_path: Optional[str] = option(
        None, "Dataset prefixes (PREFIX.bin + PREFIX.idx) or text sources (.parquet, .arrow, .jsonl files, "
              "datasets.save_to_disk directories: see --json-keys), or weighted 'W1 PREFIX1 W2 PREFIX2 ...' blended "
              "by weight; default: the built-in corpus (the Python standard library's sources, built once and cached).",
        nargs="+", metavar="[WEIGHT] PREFIX")
    json_keys: str = option(
        "text", "The keys (columns) that hold each record's documents in --data-path's Parquet, Arrow, JSON-lines "
                "files and datasets.save_to_disk directories (tokenized as they are read), as tools/preprocess_data.py "
                "--json-keys: each key gives one document.", nargs="+", metavar="KEY")
    split: str = option("969,30,1", "Train,valid,test proportions of each dataset's documents.")
    data_cache_path: Optional[str] = option(
        None, "Directory for the cached sample/shuffle/blending indices; default megalite-cache/ beside the data.")
    tokenizer_type: str = option(
        "SentencePieceTokenizer", "SentencePieceTokenizer (--tokenizer-model FILE), HuggingFaceTokenizer "
                                  "(--tokenizer-model DIR holding tokenizer.json), GPT2BPETokenizer (--vocab-file "
                                  "and --merge-file), NullTokenizer (token ids below --vocab-size, EOD = vocab size "
                                  "- 1), or Megatron's Llama2Tokenizer, GPTSentencePieceTokenizer (SentencePiece "
                                  "models) and TikTokenizer (--tokenizer-model FILE, --tiktoken-pattern). With --load "
                                  "and none of these options, the checkpoint's tokenizer.")
    tokenizer_model: Optional[str] = option(
        None, "The tokenizer of the data given by --data-path: a SentencePiece model file, a Hugging Face "
              "tokenizer's directory (tokenizer.json, tokenizer_config.json) or a TikTokenizer's JSON file.")
    vocab_file: Optional[str] = option(None, "GPT2BPETokenizer: the vocabulary (vocab.json, token -> id).")
    merge_file: Optional[str] = option(None, "GPT2BPETokenizer: the BPE merges (merges.txt).")
    tiktoken_pattern: Optional[str] = option(
        None, "With --tokenizer-type TikTokenizer: the pre-tokenization regex, v1 or v2 (Megatron's two patterns; v2 "
              "also splits a word where lower case turns to upper).")
    tiktoken_num_special_tokens: int = option(
        1000, "With TikTokenizer: ids reserved for special tokens before the BPE ranks (<unk>, <s>, </s>, then "
              "<SPECIAL_i> fillers).")
    tiktoken_special_tokens: Optional[str] = option(
        None, "With TikTokenizer: the special tokens' names in id order (must include <unk>, <s> and </s>).",
        nargs="+", metavar="TOKEN")
    no_data_prefetch: bool = option(
        False, "Read each global batch's samples on the training thread when the step starts, instead of during "
               "the step before in a background thread (into pinned memory on a GPU).")
    reset_position_ids: bool = option(
        False, "Packed documents: position ids restart at 0 after every end-of-document token.")
    reset_attention_mask: bool = option(
        False, "Packed documents: attention never crosses an end-of-document token (block-diagonal causal).")
    eod_mask_loss: bool = option(
        False, "Packed documents: no loss where the input token is an end-of-document token (the prediction of the "
               "next document's first token), as Megatron.")
    sft: bool = option(
        False, "Supervised fine-tuning: --data-path names conversations (JSONL, Parquet, Arrow, a datasets directory "
               "or a prefix from tools/preprocess_data.py --sft), rendered with the tokenizer's chat template (else "
               "the plain format), the loss on the assistant's tokens only; packed with --reset-attention-mask, else "
               "one conversation per sample, padded.")
    eval_interval: int = option(1000, "Compute the validation loss every this many iterations; 0 disables it.")
    eval_iters: int = option(100, "Global batches per validation-loss evaluation.")

    def masks_loss(self) -> bool:
        """Whether some tokens may be left out of the loss (--eod-mask-loss, --sft): then the trainer counts them."""
        return self.eod_mask_loss or self.sft

    def tokenizer_given(self) -> bool:
        """Whether any tokenizer option differs from its default (else: the built-in corpus's, or --load's)."""
        return (self.tokenizer_type != "SentencePieceTokenizer" or self.tokenizer_model is not None
                or self.vocab_file is not None or self.merge_file is not None)

    def blend(self) -> tuple[list[str], Optional[list[float]]]:
        """(prefixes, weights) of data_path: 'A B' -> ([A, B], None), '0.3 A 0.7 B' -> ([A, B], [0.3, 0.7])."""
        from megalite.config.flags import FLAG   # noqa: PLC0415 - flags import this module

        words = multi_word_values(self.data_path or "")
        if not words:
            raise ConfigError(f"{FLAG.data_path} is empty")
        try:
            float(words[0])
        except ValueError:  # the first word is a prefix: no weights
            if len(words) > 1 and os.path.exists(f"{self.data_path}.idx"):   # one path with a space, quoted only
                return [self.data_path], None                                # for the shell (or for Hydra)
            return words, None
        if len(words) % 2:
            raise ConfigError(f"{FLAG.data_path} {self.data_path!r}: weights and prefixes must come in pairs")
        weights, prefixes = words[0::2], words[1::2]
        try:
            values = [float(w) for w in weights]
        except ValueError as error:
            raise ConfigError(f"{FLAG.data_path} {self.data_path!r}: bad weight ({error})") from None
        if any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
            raise ConfigError(f"{FLAG.data_path} {self.data_path!r}: weights must be >= 0 with a positive sum")
        return prefixes, values

    def split_fractions(self) -> list[float]:
        """The three split proportions normalized to sum 1 ('99,1' means '99,1,0'; '/' separates like ',')."""
        from megalite.config.flags import FLAG   # noqa: PLC0415 - flags import this module

        try:
            parts = [float(x) for x in self.split.replace("/", ",").split(",")]
        except ValueError:
            parts = []
        if not 1 <= len(parts) <= 3 or any(not math.isfinite(x) or x < 0 for x in parts) or sum(parts) <= 0:
            raise ConfigError(f"{FLAG.split} {self.split!r} must be up to three proportions >= 0 with a positive sum, "
                              f"e.g. 969,30,1")
        parts += [0.0] * (3 - len(parts))
        return [x / sum(parts) for x in parts]


@dataclass
class TrainingConfig:
    micro_batch_size: int = option(2, "Samples per micro-batch on one data-parallel rank.")
    global_batch_size: int = option(
        8, "Samples per optimizer step over all data-parallel ranks (with a batch-size ramp: its largest, final size).")
    train_iters: Optional[int] = option(None, "Number of optimizer steps; default 20, unless --train-samples is given.")
    train_samples: Optional[int] = option(
        None, "Train on this many samples instead of a number of iterations (Megatron's sample-based training: the "
              "iterations are counted from the batch sizes, a partial last batch is dropped, and the learning-rate "
              "schedule is given in samples: --lr-warmup-samples, --lr-decay-samples).")
    rampup_batch_size: Optional[str] = option(
        None, "Batch-size ramp-up (Megatron's): START INCREMENT SAMPLES grows the global batch from START by INCREMENT "
              "at even steps over the first SAMPLES samples, up to --global-batch-size.",
        nargs="+", metavar="START INCREMENT SAMPLES")
    step_batch_size_schedule: Optional[str] = option(
        None, "Global batch size by consumed tokens: 'T0:B0 T1:B1 ...' (T0 = 0, K/M/B/T suffixes: 1e3 ... 1e12; each "
              "threshold / seq length is a sample count); the largest B must be --global-batch-size.",
        nargs="+", metavar="TOKENS:BATCH")
    seed: int = option(1234, "Seed for initialization, data order and dropout.")
    bf16: bool = option(False, "bfloat16 parameters and compute; fp32 gradients, main parameters and Adam states.")
    fp16: bool = option(False, "float16 parameters and compute with loss scaling; fp32 gradients and main parameters.")
    distributed_timeout_minutes: float = option(
        10.0, "A collective waiting longer than this (a dead or stalled rank) fails with an error instead of hanging.")
    distributed_backend: str = option(
        "nccl", "nccl (one GPU per process; on a machine without CUDA: gloo, the only choice there) or gloo (every "
                "rank on the CPU, even beside GPUs).")
    exit_signal_handler: bool = option(
        False, "On SIGTERM (what cluster schedulers send), every rank saves a checkpoint (with --save) and exits 0.")
    exit_interval: Optional[int] = option(
        None, "Stop cleanly (after a checkpoint, with --save) once the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[float] = option(
        None, "Stop cleanly (after a checkpoint, with --save) once training has run this many minutes.")
    no_check_for_nan_in_loss_and_grad: bool = option(
        False, "Do not stop on a NaN/Inf loss or gradient (by default training stops naming the iteration and "
               "ranks; with --fp16 such a step is skipped instead, until 10 in a row overflow at the lowest loss "
               "scale).")
    deepspeed_config: Optional[str] = option(
        None, "A DeepSpeed JSON config, read key by key: what megalite can honour becomes its option, what only "
              "tunes DeepSpeed's speed or memory is ignored, the rest is refused by name; \"auto\" keeps megalite's "
              "value; flags and overrides beside it win (see docs/zero_and_deepspeed.md).")
    dry_run: bool = option(
        False, "Print the planner's per-GPU memory estimate for this layout (weights, gradients, optimizer states, "
               "activations of each pipeline stage) and exit without training.")
    skip_memory_check: bool = option(
        False, "Start even when the planner's memory estimate (what --dry-run prints) exceeds this GPU's memory, or "
               "on the CPU the host's available memory for its ranks (by default refused at start-up): for when the "
               "estimate is wrong.")
    simulate_gpus: int = option(
        0, "Check this job on N simulated GPUs before paying for real ones: run one rank's real code path (model, "
           "schedule, every collective, optimizer step; two iterations) in this one process on meta tensors that "
           "stand for device memory, under NCCL's rules; print its peak memory by category beside the planner's and "
           "the collectives of a step, and exit non-zero with one line per broken rule (no torchrun needed). 0: off.",
        metavar="N")
    simulate_rank: str = option(
        "0", "With --simulate-gpus: the rank to simulate, several separated by commas, or 'all' (every rank in "
             "turn; the most loaded is reported in full).", metavar="R[,R...]|all")
    simulate_device: str = option(
        "h100", "With --simulate-gpus: the GPU whose memory the simulated ranks are checked against: h100, h200, "
                "a100 or b200.")
    manual_gc: bool = option(
        False, "Turn Python's automatic garbage collector off and collect on every rank at the same points (every "
               "--manual-gc-interval iterations and around evaluations), so no rank stalls the others at random.")
    manual_gc_interval: int = option(
        0, "With --manual-gc: collect every this many iterations (0: only around evaluations and at the end).")
    empty_unused_memory_level: int = option(
        0, "On GPUs, hand cached unused memory back to the driver: 1 after each optimizer step, 2 also after each "
           "forward-backward (fewer fragmentation failures, some speed lost); 0 never.")
    plot: Optional[str] = option(
        None, "With --dry-run: also draw that estimate as stacked bars, one per pipeline stage, into this .png, .svg "
              "or .pdf file (needs matplotlib: pip install -e \".[plot]\").", metavar="FILE")


@dataclass
class LoggingConfig:
    log_interval: int = option(1, "Print (and record) metrics every this many iterations.")
    metrics_file: Optional[str] = option(None, "Rank 0 appends one JSON object per logged iteration to this file.")
    tensorboard_dir: Optional[str] = option(None, "Write TensorBoard scalars to this directory (rank 0).")
    timing_log_level: int = option(
        0, "Per-phase timers in the log and metrics (min/max over ranks): 0 none, 1 waiting for the batch "
           "(batch-generator), forward-backward, gradient reduction and optimizer step, 2 also the pipeline's wait for its neighbours and, with --metrics-file, "
           "each pipeline step's times in FILE.steps.jsonl beside it (tools/plot_schedule.py draws them).")
    peak_tflops: Optional[float] = option(
        None, "The device's peak TFLOP/s for MFU; default: known for A100/H100/H200 (bf16 dense), else no MFU.")
    profile: bool = option(
        False, "Record a torch.profiler trace of iterations --profile-step-start + 1 to --profile-step-end on the ranks "
               "of --profile-ranks (Chrome trace JSON: TensorBoard's profiler plugin and Perfetto open it); on GPUs "
               "the same range is also marked for nsys --capture-range=cudaProfilerApi.")
    profile_step_start: int = option(10, "With --profile: the iterations already done when recording starts.")
    profile_step_end: int = option(12, "With --profile: the iterations done when recording stops.")
    profile_ranks: str = option("0", "With --profile: the global ranks that record a trace.", nargs="+",
                                metavar="RANK")
    profile_dir: Optional[str] = option(
        None, "With --profile: directory of the traces; default --tensorboard-dir, else ./megalite-profile.")
    wandb_project: Optional[str] = option(
        None, "Also log every metric to this Weights & Biases project (rank 0; needs the wandb package: pip install "
              "'megalite[wandb]'; WANDB_MODE=offline keeps the run on disk).")
    wandb_exp_name: Optional[str] = option(None, "With --wandb-project: the run's name.")
    wandb_save_dir: Optional[str] = option(None, "With --wandb-project: the directory wandb writes its files in.")

    def profile_rank_list(self) -> list[int]:
        """The ranks of --profile-ranks ('0 3' -> [0, 3]); raises ValueError on a word that is not an integer."""
        return [int(word) for word in self.profile_ranks.replace(",", " ").split()]
    quiet: bool = option(
        False, "No progress bars (checking tokens, building sample indices) and no time left (eta) on the log line.")


@dataclass
class CheckpointConfig:
    save: Optional[str] = option(
        None, "Write checkpoints to this directory (one subdirectory per saved iteration; each rank writes its own "
              "shards).")
    save_interval: Optional[int] = option(
        None, "With --save: save every this many iterations, and at the end; default: only at the end.")
    load: Optional[str] = option(
        None, "Resume from the latest complete checkpoint in this directory (or from this checkpoint directory), "
              "whatever layout it was saved at; a --load equal to --save with nothing saved yet starts afresh.")
    no_load_optim: bool = option(
        False, "With --load: do not restore optimizer state (Adam moments, fp32 main parameters, loss scale).")
    no_load_rng: bool = option(False, "With --load: do not restore the random-number generators' states.")
    finetune: bool = option(
        False, "With --load: load the model weights only and start at iteration 0 (fresh optimizer, data position "
               "and random state), into this run's model even where its options differ from the checkpoint's.")
    use_checkpoint_args: bool = option(
        False, "With --load: take every model option from the checkpoint (and, with --data-path, its tokenizer) "
               "instead of the command line; without it a resume with other model options or tokenizer is refused.")
    async_save: bool = option(
        False, "With --save: write checkpoints in the background while training goes on (torch.distributed."
               "checkpoint.async_save); each is renamed into place and pointed to once every rank has written it.")
    break_save_lock: bool = option(
        False, "With --save: take the directory's lock (SAVE/.megalite.lock, one job per --save) even from an owner "
               "on another host that cannot be seen to have ended; only when that job is known to be gone.")
    override_newer_checkpoint: bool = option(
        False, "With --save: save even where --save already points to a newer checkpoint than this run starts from "
               "(its saves replace those iterations and move the pointer back).")


@dataclass
class KernelConfig:
    use_fused_kernels: str = option(
        "auto", "auto (fused CUDA kernels for LayerNorm/RMSNorm, bias + GeLU, rotary embeddings and the cross entropy "
                "where the input is on a GPU and the extension builds, torch ops elsewhere), on (also the fused "
                "masked-softmax attention core instead of scaled_dot_product_attention; a failed build is an error) "
                "or off (torch ops only).")
    no_masked_softmax_fusion: bool = option(
        False, "With --use-fused-kernels on: keep scaled_dot_product_attention instead of the fused causal softmax.")
    no_bias_gelu_fusion: bool = option(False, "Add the MLP's first bias and apply GeLU with torch ops, not fused.")
    no_layernorm_fusion: bool = option(False, "Run LayerNorm and RMSNorm with torch ops, not the fused kernels.")
    no_rope_fusion: bool = option(False, "Apply rotary embeddings with torch ops, not the fused kernel.")
    no_cross_entropy_loss_fusion: bool = option(
        False, "Compute the vocab-parallel cross entropy with torch ops, not the fused per-shard kernels (fused by "
               "default here, where Megatron's --cross-entropy-loss-fusion is opt-in).")
    torch_compile: bool = option(
        False, "torch.compile each transformer layer on its own (torchtitan's approach; in an MoE layer only the "
               "attention, the token routing stays eager): the compiler fuses the layer's ops, so the norms, bias + "
               "GeLU and rotary embeddings run as torch ops inside it, not as megalite's fused kernels.")
    torch_compile_backend: str = option(
        "inductor", "With --torch-compile: torch.compile's backend (inductor generates the fused code; aot_eager "
                    "traces the same graphs, forward and backward, and runs them op by op: fast to compile).")


@dataclass
class MegaliteConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    kernels: KernelConfig = dataclasses.field(default_factory=KernelConfig)


def sections() -> list[tuple[str, type]]:
    """(section name, section dataclass) pairs of MegaliteConfig, in declaration order."""
    hints = typing.get_type_hints(MegaliteConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(MegaliteConfig)]


def to_dict(cfg: MegaliteConfig) -> dict[str, Any]:
    """The config as a plain nested dict (section -> field -> value), for checkpoints and logs."""
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any]) -> tuple[MegaliteConfig, list[str]]:
    """A config from :func:`to_dict`'s form, and the ``section.field`` keys this schema does not know (an older or
    newer megalite wrote them), which are left out."""
    values, unknown = {}, []
    for section, cls in sections():
        given = dict(data.get(section) or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown += [f"{section}.{key}" for key in given if key not in names]
        values[section] = cls(**{key: value for key, value in given.items() if key in names})
    unknown += [key for key in data if key not in values]
    return MegaliteConfig(**values), unknown
