"""Megatron-LM's stored ``args`` Namespace <-> megalite's model options.

Every Megatron checkpoint stores the Namespace its ``parse_args`` produced (common.pt of a torch_dist directory, each
model_optim_rng.pt of a legacy one). megalite's options are named after Megatron's flags, so an option reads the
attribute of its own name; :data:`RENAMED` lists the few whose Megatron attribute is spelled otherwise (older
Megatron versions spelled some differently again: the first name present is read, and an export writes them all).
:data:`UNSUPPORTED` lists what Megatron can store that megalite's model cannot compute, each with the value that
means "off": an import refuses any other value by its flag, before a tensor is read.

The vocabulary: Megatron stores its embedding padded to ``padded_vocab_size`` (a multiple of
make_vocab_size_divisible_by x TP) and the true size only where a tokenizer option says it: ``vocab_size``
(``--vocab-size``, NullTokenizer), else the tokenizer the import found (:mod:`.files`), else the padded size.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.config import ModelConfig
from megalite.config.dims import ParallelDims
from megalite.config.schema import MODEL_DEFINING

# megalite option -> the attributes Megatron stores it under, newest first (Megatron 0.16 generates these flags from
# its TransformerConfig, whose field names differ from the flags; earlier versions used the flag's own name).
RENAMED = {"layernorm_epsilon": ("layernorm_epsilon", "norm_epsilon"),
           "apply_layernorm_1p": ("layernorm_zero_centered_gamma", "apply_layernorm_1p")}
# megalite option -> Megatron's attribute holding its negation (Megatron's --disable-bias-linear and
# --no-position-embedding store False into these).
NEGATED = {"disable_bias_linear": "add_bias_linear", "no_position_embedding": "add_position_embedding"}
# Model options megalite has and Megatron does not (Megatron fixes them at these values in its rope scaling; its
# GPT has no linear or yarn scaling: YaRN is for multi-latent attention only).
MEGALITE_ONLY = ("rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                 "rope_scaling_original_max_position_embeddings", "rope_scaling_type", "beta_fast", "beta_slow",
                 "rope_scaling_attention_factor", "yarn_unrounded_correction_range")
# Gemma 3's model options, which Megatron-LM's GPT has no flag for (Megatron-core's softmax_scale and
# gated_linear_unit are TransformerConfig fields without one): never read on import, refused on export.
GEMMA_ONLY = ("sandwich_norm", "scale_embeddings", "gated_linear_unit", "softmax_scale", "local_rotary_base")
# Options read besides the model-defining ones: the sample length and vocabulary padding a resumed run keeps.
CARRIED = ("seq_length", "make_vocab_size_divisible_by")

# Megatron attribute -> (the values megalite computes the same, the flag that sets it): anything else is refused.
UNSUPPORTED = {
    "squared_relu": ((False, None), "--squared-relu"),
    "quick_geglu": ((False, None), "--quick-geglu"),
    "rotary_interleaved": ((False, None), "--rotary-interleaved"),
    "multi_latent_attention": ((False, None), "--multi-latent-attention"),
    "mtp_num_layers": ((None, 0), "--mtp-num-layers"),
    "moe_latent_size": ((None,), "--moe-latent-size"),
    "window_size": ((None,), "--window-size"),
    "softmax_type": (("vanilla", None), "--softmax-type"),
    "qk_l2_norm": ((False, None), "--qk-l2-norm"),
    "attention_output_gate": ((False, None), "--attention-output-gate"),
    "rotary_seq_len_interpolation_factor": ((None,), "--rotary-seq-len-interpolation-factor"),
    "no_rope_freq": ((None,), "--no-rope-freq"),
    "heterogeneous_layers_config_path": ((None,), "--heterogeneous-layers-config-path"),
    "heterogeneous_layers_config_encoded_json": ((None,), "--heterogeneous-layers-config-encoded-json"),
    "is_hybrid_model": ((False, None), "--is-hybrid-model (Mamba layers)"),
    "hybrid_override_pattern": ((None,), "--hybrid-override-pattern (Mamba layers)"),
    "experimental_attention_variant": ((None,), "--experimental-attention-variant"),
    "use_legacy_models": ((False, None), "--use-legacy-models (megatron.legacy's GPT)"),
    "glu_linear_offset": ((0.0, None), "--glu-linear-offset"),
    "activation_func_clamp_value": ((None,), "--activation-func-clamp-value"),
    "moe_router_topk_limited_devices": ((None,), "--moe-router-topk-limited-devices"),
}
# Of those, the options megalite's model has but Megatron-LM conversion does not map (untested against Megatron).
NOT_CONVERTED = ("window_size", "softmax_type", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")


def refuse_unsupported(args: argparse.Namespace) -> None:
    """Raise CheckpointError naming the first Megatron option megalite's model cannot compute."""
    for name, (neutral, flag) in UNSUPPORTED.items():
        value = getattr(args, name, neutral[0])
        if value not in neutral:
            raise CheckpointError(f"the Megatron checkpoint uses {flag} ({name}={value!r}): " + (
                "megalite converts no such model from Megatron-LM" if name in NOT_CONVERTED else
                "megalite's model has no such option"))
    kind = getattr(args, "position_embedding_type", "learned_absolute")
    if kind not in POSITION_EMBEDDINGS:
        raise CheckpointError(f"the Megatron checkpoint uses --position-embedding-type {kind}: megalite has "
                              f"{' and '.join(POSITION_EMBEDDINGS)}")


def _megatron_names(option: str) -> tuple[str, ...]:
    return RENAMED.get(option, (option,))


def _moe_layer_freq(value: Any) -> str:
    """Megatron stores an int (one MoE layer in N) or the evaluated list of 0/1; megalite's option is the text."""
    return str(value) if isinstance(value, int) else "[" + ",".join(str(int(v)) for v in value) + "]"


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The megalite model a Megatron checkpoint's args describe (its options read by name, see the module
    docstring); ``vocab_size`` is the true vocabulary."""
    refuse_unsupported(args)
    if getattr(args, "disable_bias_linear", None) is not None:   # foundation-model checkpoints store this spelling
        args = argparse.Namespace(**{**vars(args), "add_bias_linear": not args.disable_bias_linear})
    values: dict[str, Any] = {}
    for option in (*MODEL_DEFINING, *CARRIED):
        if option == "vocab_size" or option in MEGALITE_ONLY or option in GEMMA_ONLY:
            continue
        if option in NEGATED:
            stored = getattr(args, NEGATED[option], None)
            if stored is not None:
                values[option] = not stored
            continue
        stored = next((getattr(args, name) for name in _megatron_names(option)
                       if getattr(args, name, None) is not None), None)
        if stored is not None:
            values[option] = _moe_layer_freq(stored) if option == "moe_layer_freq" else stored
    if values.get("position_embedding_type") == "rope":
        values["no_position_embedding"] = False   # Megatron stores add_position_embedding=False beside rope
    if not values.get("group_query_attention"):
        values.pop("num_query_groups", None)
    if values.get("num_experts") is None:
        values = {k: v for k, v in values.items() if not k.startswith("moe_")}
    if not values.get("mtp_num_layers"):   # Megatron's 0 is no MTP (any other count was refused above)
        values.pop("mtp_num_layers", None)
    values["vocab_size"] = vocab_size
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"the Megatron checkpoint's args make no megalite model: {error}") from None


def megatron_args(model: ModelConfig, dims: ParallelDims, virtual_stages: Optional[int], *, iteration: int,
                  consumed_samples: int, ckpt_format: str, dtype: torch.dtype) -> argparse.Namespace:
    """The args Namespace Megatron-LM would have stored for this model saved at this layout: every model option
    under each of its Megatron names, the layout, the vocabulary (true and padded) and the format."""
    for option in MEGALITE_ONLY:
        default = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == option)
        if getattr(model, option) != default:
            raise CheckpointError(f"model option {option}={getattr(model, option)!r}: Megatron's rope scaling fixes "
                                  f"it at {default!r}")
    if model.window_size is not None:   # as the import refuses Megatron's (UNSUPPORTED)
        raise CheckpointError(f"model option window_size={model.window_size!r}: megalite exports no sliding window "
                              f"to Megatron-LM")
    if model.softmax_type != "vanilla":   # as the import refuses Megatron's (UNSUPPORTED)
        raise CheckpointError(f"model option softmax_type={model.softmax_type!r}: megalite exports no attention "
                              f"sink to Megatron-LM")
    if model.multi_latent_attention:   # as the import refuses Megatron's (UNSUPPORTED)
        raise CheckpointError("model option multi_latent_attention=True: megalite exports no multi-latent attention "
                              "to Megatron-LM")
    if model.mtp_num_layers is not None:   # as the import refuses Megatron's (UNSUPPORTED)
        raise CheckpointError(f"model option mtp_num_layers={model.mtp_num_layers}: megalite exports no "
                              f"multi-token prediction to Megatron-LM (its mtp.layers.K.* weights are not mapped)")
    for option, default in (("quick_geglu", False), ("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)):
        if getattr(model, option) != default:   # as the import refuses Megatron's (UNSUPPORTED): untested there
            raise CheckpointError(f"model option {option}={getattr(model, option)!r}: megalite exports no gpt-oss "
                                  f"activation (quick GeGLU, its offset and clamp) to Megatron-LM")
    gemma = next((option for option in GEMMA_ONLY if getattr(model, option) != getattr(ModelConfig(), option)), None)
    if gemma is not None:
        raise CheckpointError(f"model option {gemma}={getattr(model, gemma)!r}: Megatron-LM's GPT has no flag for it "
                              f"(a Gemma 3 option: export to Hugging Face's Gemma3ForCausalLM instead)")
    values: dict[str, Any] = {}
    for option in (*MODEL_DEFINING, *CARRIED):
        if option in MEGALITE_ONLY or option in GEMMA_ONLY:
            continue
        value = getattr(model, option)
        if option in NEGATED:
            values[NEGATED[option]] = not value
        else:
            values.update({name: value for name in _megatron_names(option)})
    rope = model.position_embedding_type == "rope"
    values.update(
        add_position_embedding=not rope and not model.no_position_embedding,
        use_rotary_position_embeddings=rope,
        num_query_groups=model.query_groups,
        ffn_hidden_size=model.ffn_size, kv_channels=model.head_dim,
        max_position_embeddings=model.max_positions, moe_layer_freq=_megatron_layer_freq(model),
        padded_vocab_size=model.padded_vocab_size(dims.tp),
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=virtual_stages, expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.expert_tp, context_parallel_size=1, world_size=dims.world,
        data_parallel_size=dims.dp, ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format != "torch",
        iteration=iteration, consumed_train_samples=consumed_samples, consumed_valid_samples=0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        hidden_dropout=0.0, attention_dropout=0.0, no_save_optim=True, no_save_rng=True)
    return argparse.Namespace(**values)


def _megatron_layer_freq(model: ModelConfig) -> Any:
    """megalite's --moe-layer-freq as Megatron stores it (an int, or the list of 0/1 per layer)."""
    text = str(model.moe_layer_freq).strip()
    return int(text) if text.isdigit() else [int(moe) for moe in model.moe_layers()]


# What Megatron-LM's --use-checkpoint-args takes from a checkpoint's args (load_args_from_checkpoint at core_v0.16.1);
# it reads every other option from its own command line. (It also sets apply_layernorm_1p, which 0.16 no longer reads.)
TAKEN_BY_USE_CHECKPOINT_ARGS = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "rotary_interleaved",
    "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu", "untie_embeddings_and_output_weights",
    "normalization", "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout", "num_experts",
    "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_token_dispatcher_type", "moe_router_pre_softmax",
    "moe_grouped_gemm", "moe_shared_expert_intermediate_size", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "padded_vocab_size", "tokenizer_model",
    "tokenizer_type"})
# Megatron's flag of a megalite option where it is not the option's name with dashes.
_FLAGS = {"layernorm_epsilon": "--norm-epsilon", "disable_bias_linear": "--disable-bias-linear",
          "no_position_embedding": "--no-position-embedding"}


def flags_not_taken(model: ModelConfig) -> list[str]:
    """The Megatron flags that give this model's options --use-checkpoint-args leaves at Megatron's defaults."""
    defaults = ModelConfig()
    flags = []
    for option in MODEL_DEFINING:
        if option in MEGALITE_ONLY or option in GEMMA_ONLY or option == "vocab_size":
            continue
        if {NEGATED.get(option, option), *_megatron_names(option)} & TAKEN_BY_USE_CHECKPOINT_ARGS:
            continue
        value = getattr(model, option)
        if value == getattr(defaults, option):
            continue
        flag = _FLAGS.get(option, "--" + option.replace("_", "-"))
        flags.append(flag if isinstance(value, bool) else f"{flag} {value}")
    return flags
