"""Parameter counts from the exact architecture: every tensor a rank holds, in the order the model defines it.

Not 12 L h^2: the count follows the config the way ``megalite.model`` builds it (tests compare it with the real model
built on the ``meta`` device, for every config in ``configs/model``, at several TP/PP sizes, rank by rank):

- word embedding: padded vocabulary x h, rows split over TP, where the vocabulary is padded to a multiple of
  ``make_vocab_size_divisible_by`` x TP (Megatron's rule; the padding rows are real memory);
- learned positions (``learned_absolute`` only): max positions x h, replicated;
- per layer: two norms (four with --sandwich-norm; LayerNorm: weight and bias, 2h; RMSNorm: h), the fused QKV
  projection h x (h + 2 G d) (G key/value heads of dimension d; G = heads without grouped-query attention) with its
  bias, the output projection h x h with a replicated bias, the MLP's h x f (gated, SwiGLU or GeGLU: h x 2f, gate and
  up) and f x h with biases, unless ``disable_bias_linear`` (``add_qkv_bias`` keeps the QKV one); every matrix split over TP, the row-parallel biases
  replicated; with learnable attention sinks (--softmax-type learnable), one logit per head, split over TP; with
  multi-latent attention, its replicated down-projections and latent norms and its up-projections split by heads;
- final norm, and the output layer (padded vocabulary x h over TP) unless it is tied to the word embedding; tied and
  on another pipeline stage, the last stage holds a copy of the embedding (real memory, not a new parameter);
- multi-token prediction (--mtp-num-layers, on the last stage): per depth two norms, the h x 2h projection (split over
  TP) and one transformer layer like the last one; a last stage without the embedding holds a copy of it.

For GPT-2/3 shapes (f = 4h, no grouping) the layers sum to 12 L h^2 + 13 L h, the familiar approximation.

A mixture-of-experts layer holds, in place of the MLP, its router (E x h, replicated), E / EP experts (each an MLP
of the expert hidden size, split over the experts' TP) and its shared expert (an MLP, with its 1 x h gate); the
model's *active* parameters are those one token uses: the total less (E - k) / E of the experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megalite.config import ModelConfig
from megalite.pipeline.partition import chunks_of_rank


@dataclass(frozen=True)
class Tensor:
    """One parameter as a rank holds it."""
    name: str            # canonical name (layers numbered globally; a tied copy is named after the embedding)
    numel: int           # elements on this rank (vocabulary padding included)
    full_numel: int      # elements of the canonical, unpadded tensor
    rows: int = 0        # dim 0 on this rank, which ZeRO-3 shards over DP (0: a vector, numel rows of one element)
    deferred: bool = False   # a tied word embedding (or the last stage's copy): its own gradient bucket
    expert: bool = False     # a routed expert's: its own engine over the expert-data-parallel ranks
    fp8: bool = False        # an FP8 linear's weight: its own buckets under the distributed optimizer
    tp_dim: Optional[int] = None   # the dimension TP splits: 0 rows (column-parallel), 1 columns (row-parallel)

    @property
    def dim0(self) -> int:
        """The rows FSDP2's Shard(0) cuts: a matrix's first dimension, a vector's length."""
        return self.rows or self.numel


def _norm(cfg: ModelConfig, prefix: str) -> list[Tensor]:
    h = cfg.hidden_size
    names = ["weight"] if cfg.normalization == "RMSNorm" else ["weight", "bias"]
    return [Tensor(f"{prefix}.{n}", h, h) for n in names]


def _column(name: str, rows: int, cols: int, tp: int) -> Tensor:
    """A column-parallel matrix (or bias, cols = 1): its output rows split over TP."""
    return Tensor(name, rows * cols // tp, rows * cols, rows=rows // tp if cols > 1 else 0, tp_dim=0)


def _row(name: str, rows: int, cols: int, tp: int) -> Tensor:
    """A row-parallel matrix: its input columns split over TP, all its rows on every rank."""
    return Tensor(name, rows * cols // tp, rows * cols, rows=rows, tp_dim=1)


def layer_tensors(cfg: ModelConfig, tp: int, index: int, ep: int = 1, expert_tp: int | None = None,
                  prefix: str | None = None) -> list[Tensor]:
    """One transformer layer's parameters at TP ``tp`` (megalite.model.transformer, attention, mlp or moe). An MoE
    layer holds its router, E / ``ep`` experts (split over ``expert_tp``, default TP) and its shared expert. Layers
    numbered after the model's (multi-token prediction's, named ``prefix``) are built like its last."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = cfg.query_size + 2 * cfg.query_groups * d
    bias = not cfg.disable_bias_linear
    p = prefix or f"layers.{index}"
    index = min(index, cfg.num_layers - 1)

    def fp8(weight: Tensor, expert: bool) -> Tensor:
        """The weight of an FP8 linear (--fp8-format: attention, MLP and shared expert; routed experts stay bf16)."""
        return dataclasses.replace(weight, fp8=cfg.fp8_format is not None and not expert)

    def column(name: str, rows: int, world: int = tp, expert: bool = False, biased: bool = bias) -> list[Tensor]:
        """A weight, then its bias split like its rows."""
        tensors = [fp8(_column(f"{name}.weight", rows, h, world), expert)] + (
            [_column(f"{name}.bias", rows, 1, world)] if biased else [])
        return [dataclasses.replace(t, expert=expert) for t in tensors]

    def row(name: str, cols: int, world: int = tp, expert: bool = False) -> list[Tensor]:
        """A weight, then its replicated bias."""
        tensors = [fp8(_row(f"{name}.weight", h, cols, world), expert)] + (
            [Tensor(f"{name}.bias", h, h)] if bias else [])
        return [dataclasses.replace(t, expert=expert) for t in tensors]

    def mlp(name: str, f: int, world: int = tp, expert: bool = False) -> list[Tensor]:
        return (column(f"{name}.linear_fc1", 2 * f if cfg.gated_mlp else f, world, expert)
                + row(f"{name}.linear_fc2", f, world, expert))

    attention = _norm(cfg, f"{p}.input_norm")
    if cfg.softmax_type == "learnable":   # one sink logit per head, split over TP (the module's own parameter, first)
        attention.append(_column(f"{p}.self_attention.softmax_offset", cfg.num_attention_heads, 1, tp))
    if cfg.qk_layernorm:   # per-head norms over the head dimension, replicated
        attention += [Tensor(t.name, d, d) for t in _norm(cfg, f"{p}.self_attention.q_layernorm")
                      + _norm(cfg, f"{p}.self_attention.k_layernorm")]
    if cfg.multi_latent_attention:
        attention += _latent_attention(cfg, tp, f"{p}.self_attention", column, row)
    else:
        attention += (column(f"{p}.self_attention.linear_qkv", qkv, biased=bias or cfg.add_qkv_bias)
                      + row(f"{p}.self_attention.linear_proj", cfg.query_size))
    if cfg.sandwich_norm:   # the attention output's norm, before the residual add
        attention += _norm(cfg, f"{p}.post_attention_norm")
    attention += _norm(cfg, f"{p}.pre_mlp_norm")
    post_mlp = _norm(cfg, f"{p}.post_mlp_norm") if cfg.sandwich_norm else []
    if cfg.num_experts is None or not cfg.moe_layers()[index]:
        return attention + mlp(f"{p}.mlp", cfg.ffn_size) + post_mlp
    experts = cfg.num_experts
    tensors = attention + [Tensor(f"{p}.mlp.router.weight", experts * h, experts * h, rows=experts)]
    if bias:   # the router's logits have a bias with the linears' (Megatron's; gpt-oss)
        tensors.append(Tensor(f"{p}.mlp.router.bias", experts, experts))
    for e in range(experts // ep):   # the experts of expert-parallel rank 0 (every rank holds as many)
        tensors += mlp(f"{p}.mlp.experts.{e}", cfg.expert_ffn_size, tp if expert_tp is None else expert_tp, True)
    if cfg.moe_shared_expert_intermediate_size:
        gate = [Tensor(f"{p}.mlp.shared_experts.gate_weight", h, h, rows=1)] if cfg.moe_shared_expert_gate else []
        tensors += gate + mlp(f"{p}.mlp.shared_experts", cfg.moe_shared_expert_intermediate_size)
    return tensors + post_mlp


def _latent_attention(cfg: ModelConfig, tp: int, prefix: str, column, row) -> list[Tensor]:
    """Multi-latent attention (megalite.model.latent_attention, no biases): the replicated down-projections and
    latent norms, the up-projections split over TP by heads, the output projection."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk, rope = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.qk_pos_emb_head_dim

    def replicated(name: str, rows: int, cols: int) -> Tensor:
        return Tensor(f"{prefix}.{name}.weight", rows * cols, rows * cols, rows=rows)

    def latent_norm(name: str, channels: int) -> list[Tensor]:
        return _norm(dataclasses.replace(cfg, hidden_size=channels), f"{prefix}.{name}")

    if cfg.q_lora_rank is None:
        tensors = column(f"{prefix}.linear_q_proj", heads * qk, biased=False)
    else:
        tensors = [replicated("linear_q_down_proj", cfg.q_lora_rank, h), *latent_norm("q_layernorm", cfg.q_lora_rank),
                   _column(f"{prefix}.linear_q_up_proj.weight", heads * qk, cfg.q_lora_rank, tp)]
    tensors += [replicated("linear_kv_down_proj", cfg.kv_lora_rank + rope, h),
                *latent_norm("kv_layernorm", cfg.kv_lora_rank),
                _column(f"{prefix}.linear_kv_up_proj.weight", heads * (cfg.qk_head_dim + cfg.v_head_dim),
                        cfg.kv_lora_rank, tp)]
    return tensors + row(f"{prefix}.linear_proj", heads * cfg.v_head_dim)


def mtp_tensors(cfg: ModelConfig, tp: int, ep: int = 1, expert_tp: int | None = None) -> list[Tensor]:
    """Multi-token prediction's modules (megalite.model.multi_token_prediction), in definition order."""
    tensors: list[Tensor] = []
    for k in range(cfg.mtp_num_layers or 0):
        p = f"mtp.layers.{k}"
        tensors += (_norm(cfg, f"{p}.enorm") + _norm(cfg, f"{p}.hnorm")
                    + [_column(f"{p}.eh_proj.weight", cfg.hidden_size, 2 * cfg.hidden_size, tp)]
                    + layer_tensors(cfg, tp, cfg.num_layers + k, ep, expert_tp, f"{p}.transformer_layer")
                    + _norm(cfg, f"{p}.final_norm"))
    return tensors


def chunk_tensors(cfg: ModelConfig, tp: int, first_layer: int, num_layers: int, pre_process: bool,
                  post_process: bool, ep: int = 1, expert_tp: int | None = None) -> list[Tensor]:
    """A model chunk's parameters in definition order (megalite.model.gpt.GPTModel)."""
    h = cfg.hidden_size
    vocab = cfg.padded_vocab_size(tp)
    tied = not cfg.untie_embeddings_and_output_weights
    mtp = post_process and cfg.mtp_num_layers is not None
    tensors: list[Tensor] = []
    if mtp and not pre_process:   # the embedding's copy, tied to the first stage's
        tensors.append(Tensor("embedding.word.weight", vocab * h // tp, cfg.vocab_size * h, vocab // tp,
                              deferred=True))
    if pre_process:
        # A tied embedding is "deferred" whether or not the output layer sits on the same stage (the trainer passes
        # every chunk's tied_embedding_weights() to the data-parallel engine).
        tensors.append(Tensor("embedding.word.weight", vocab * h // tp, cfg.vocab_size * h, vocab // tp,
                              deferred=tied or cfg.mtp_num_layers is not None))
        if cfg.learned_positions:
            tensors.append(Tensor("embedding.position.weight", cfg.max_positions * h, cfg.max_positions * h,
                                  cfg.max_positions))
    for i in range(first_layer, first_layer + num_layers):
        tensors += layer_tensors(cfg, tp, i, ep, expert_tp)
    if mtp:
        tensors += mtp_tensors(cfg, tp, ep, expert_tp)
    if post_process:
        tensors += _norm(cfg, "final_norm")
        if not tied:
            tensors.append(Tensor("output_layer.weight", vocab * h // tp, cfg.vocab_size * h, vocab // tp))
        elif not pre_process and not mtp:
            tensors.append(Tensor("embedding.word.weight", vocab * h // tp, cfg.vocab_size * h, vocab // tp,
                                  deferred=True))
    return tensors


def rank_tensors(cfg: ModelConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int,
                 placement: str = "round-robin", *, ep: int = 1, expert_tp: int | None = None,
                 split: Optional[tuple[int, ...]] = None) -> list[list[Tensor]]:
    """Every model chunk of pipeline rank ``pp_rank`` (megalite.pipeline.partition), each a list of tensors;
    ``split``: the layers of each virtual stage when uneven (ParallelConfig.pipeline_split)."""
    return [chunk_tensors(cfg, tp, c.first_layer, c.num_layers, c.is_first, c.is_last, ep, expert_tp)
            for c in chunks_of_rank(split or cfg.num_layers, pp, virtual_stages, pp_rank, placement)]


@dataclass(frozen=True)
class ParameterCount:
    total: int                 # the model's parameters: canonical, unpadded, each counted once
    per_stage: list[int]       # elements held by one rank of each pipeline stage (padding and tied copy included)
    embedding: int             # word (+ position) embedding, canonical
    per_layer: int             # one transformer layer, canonical (the first)
    experts: int = 0           # of total: the routed experts' (mixture of experts)
    active: int = 0            # what one token uses: total less the experts it is not routed to

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def count_parameters(cfg: ModelConfig, tp: int = 1, pp: int = 1, virtual_stages: int = 1,
                     placement: str = "round-robin", *, ep: int = 1, expert_tp: int | None = None,
                     split: Optional[tuple[int, ...]] = None) -> ParameterCount:
    """The model's size and what each rank holds at this layout."""
    per_stage = [sum(t.numel for chunk in rank_tensors(cfg, tp, pp, virtual_stages, r, placement, ep=ep,
                                                       expert_tp=expert_tp, split=split) for t in chunk)
                 for r in range(pp)]
    canonical = {t.name: (t.full_numel, t.expert) for r in range(pp)
                 for chunk in rank_tensors(cfg, tp, pp, virtual_stages, r, placement, split=split) for t in chunk}
    per_layer = sum(t.full_numel for t in layer_tensors(cfg, 1, 0))
    embedding = canonical["embedding.word.weight"][0] + canonical.get("embedding.position.weight", (0, False))[0]
    total = sum(n for n, _ in canonical.values())
    experts = sum(n for n, expert in canonical.values() if expert)
    inactive = experts * (1 - cfg.moe_router_topk / cfg.num_experts) if experts else 0
    return ParameterCount(total, per_stage, embedding, per_layer, experts, round(total - inactive))
