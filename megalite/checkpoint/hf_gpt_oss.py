"""Megalite's gpt-oss <-> Hugging Face ``GptOssForCausalLM``: names, shapes and config.

gpt-oss is a mixture of experts in every layer with biases everywhere, attention sinks and alternating windows:

- attention: q/k/v/o projections with biases (megalite's linears with biases: ``--disable-bias-linear`` off),
  grouped-query heads of ``head_dim`` (``--kv-channels``), one learned sink logit per head (``self_attn.sinks``:
  ``--softmax-type learnable``, megalite's ``softmax_offset``), a window of ``sliding_window`` on the layers
  ``layer_types`` calls ``sliding_attention`` (``--window-size W-1,0`` with ``--window-attn-skip-freq``'s pattern),
  YaRN rope whose correction range is not rounded (``truncate: false``: ``--yarn-unrounded-correction-range``);
- router: a linear with a bias (``mlp.router.weight``/``bias``: megalite's router has the bias with the linears'),
  softmax over the k chosen logits (megalite's default);
- experts: ``gate_up_proj`` [E, h, 2f] (transposed: x @ W) with gate and up *interleaved* along the last dimension
  (gate the even columns, up the odd ones) and a bias; ``down_proj`` [E, f, h] with a bias. Their activation,
  (clamp(up, -limit, limit) + 1) x gate' sigmoid(alpha gate') with gate' = min(gate, limit), is Megatron's clamped
  quick GeGLU: ``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value limit`` (alpha is quick GeLU's
  1.702: another is refused). megalite's fc1 is [gate; up] stacked, ``[f, h]`` each, fc2 ``[h, f]``.

The hub's own gpt-oss weights are MXFP4-quantized (``quantization_config``): refused, dequantize them first (what
transformers' ``Mxfp4Config(dequantize=True)`` loads and ``save_pretrained`` then writes is read here).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megalite.checkpoint import hf_llama
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.model_specs import check_options_mapped
from megalite.config import ModelConfig

ARCHITECTURE, MODEL_TYPE = "GptOssForCausalLM", "gpt_oss"
QUICK_GELU_ALPHA = 1.702

# The options the export requires, with their values; with the mapped ones below, every model-defining option.
GPT_OSS_OPTIONS = {"position_embedding_type": "rope", "normalization": "RMSNorm", "quick_geglu": True,
                   "glu_linear_offset": 1.0, "disable_bias_linear": False, "softmax_type": "learnable"}
_MAPPED_FIELDS = (hf_llama._MAPPED_FIELDS - {"swiglu", "qk_layernorm"}) | set(GPT_OSS_OPTIONS) | {
    "activation_func_clamp_value", "yarn_unrounded_correction_range", "num_experts", "moe_ffn_hidden_size",
    "moe_router_topk"}

# GptOssConfig's defaults, for config.json files that leave keys out.
_HF_DEFAULTS = {"num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
                "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
                "sliding_window": 128, "tie_word_embeddings": False, "initializer_range": 0.02,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_dropout": 0.0,
                "num_experts_per_tok": 4, "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": 7.0,
                "router_aux_loss_coef": 0.001, "layer_types": None, "attention_bias": True, "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}}

_ATTENTION = [("input_norm.weight", "input_layernorm.weight"),
              ("pre_mlp_norm.weight", "post_attention_layernorm.weight"),
              ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
              ("self_attention.linear_proj.bias", "self_attn.o_proj.bias"),
              ("self_attention.softmax_offset", "self_attn.sinks"),
              ("mlp.router.weight", "mlp.router.weight"), ("mlp.router.bias", "mlp.router.bias")]
_QKV = [(f"self_attention.linear_qkv.{kind}", [f"self_attn.{p}_proj.{kind}" for p in "qkv"])
        for kind in ("weight", "bias")]
_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def is_gpt_oss_shaped(model: ModelConfig) -> bool:
    """Whether a mixture of experts uses a gpt-oss option (and so can only export as gpt-oss)."""
    return model.quick_geglu or model.softmax_type != "vanilla" or not model.disable_bias_linear


def check_exportable(model: ModelConfig) -> None:
    """Raise CheckpointError unless the model is exactly a gpt-oss."""
    for name, wanted in GPT_OSS_OPTIONS.items():
        if getattr(model, name) != wanted:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: model option {name}={getattr(model, name)!r} "
                                  f"(it needs {name}={wanted!r})")
    refusals = [(model.activation_func_clamp_value is None, "activation_func_clamp_value"),
                (model.num_experts is None or not all(model.moe_layers()), "moe_layer_freq")]
    for refused, name in refusals:
        if refused:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: model option {name}={getattr(model, name)!r} "
                                  f"has no {ARCHITECTURE} counterpart")
    check_options_mapped(model, _MAPPED_FIELDS, ARCHITECTURE, "GptOss")


# ---- tensors --------------------------------------------------------------------------------------------------------

def to_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical megalite tensors -> GptOssForCausalLM's state dict (experts fused, gate and up interleaved)."""
    check_exportable(model)
    tensors = dict(tensors)
    result = {"model.embed_tokens.weight": tensors.pop("embedding.word.weight"),
              "model.norm.weight": tensors.pop("final_norm.weight")}
    if model.untie_embeddings_and_output_weights:
        result["lm_head.weight"] = tensors.pop("output_layer.weight")
    q, kv = model.query_size, model.query_groups * model.head_dim
    for i in range(model.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for m, h in _ATTENTION:
            result[theirs + h] = tensors.pop(ours + m)
        for m, hf_names in _QKV:
            for h, block in zip(hf_names, tensors.pop(ours + m).split([q, kv, kv]), strict=True):
                result[theirs + h] = block
        experts = [[tensors.pop(f"{ours}mlp.experts.{j}.linear_fc{n}.{kind}") for j in range(model.num_experts)]
                   for n, kind in ((1, "weight"), (1, "bias"), (2, "weight"), (2, "bias"))]
        fc1, fc1_bias, fc2, fc2_bias = (torch.stack(e) for e in experts)
        result.update({theirs + "mlp.experts." + name: tensor for name, tensor in zip(_EXPERTS, (
            _interleaved(fc1).transpose(1, 2), _interleaved(fc1_bias), fc2.transpose(1, 2), fc2_bias))})
    if tensors:
        raise CheckpointError(f"cannot export as {ARCHITECTURE}: it has no counterpart of {sorted(tensors)[0]}")
    return {name: t.contiguous() for name, t in result.items()}


def _interleaved(stacked: torch.Tensor) -> torch.Tensor:
    """[E, 2f, ...] stacked [gate; up] -> gate and up rows alternating (gate first), as gpt-oss' gate_up_proj."""
    gate, up = stacked.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """GptOssForCausalLM's state dict (with or without the ``model.`` prefix) -> canonical megalite tensors."""
    named = hf_llama.hf_state_dict(tensors, model)

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in named:
            raise CheckpointError(f"input has no {name}")
        tensor = named.pop(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"input tensor {name} is {list(tensor.shape)}, the config says {list(shape)}")
        return tensor

    h, v, f, e = model.hidden_size, model.vocab_size, model.expert_ffn_size, model.num_experts
    q, kv, heads = model.query_size, model.query_groups * model.head_dim, model.num_attention_heads
    result = {"embedding.word.weight": take("model.embed_tokens.weight", (v, h)),
              "final_norm.weight": take("model.norm.weight", (h,))}
    if model.untie_embeddings_and_output_weights:
        result["output_layer.weight"] = take("lm_head.weight", (v, h))
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.o_proj.weight": (h, q), "self_attn.o_proj.bias": (h,), "self_attn.sinks": (heads,),
              "mlp.router.weight": (e, h),
              "mlp.router.bias": (e,)}
    for i in range(model.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for m, hf_name in _ATTENTION:
            result[ours + m] = take(theirs + hf_name, shapes[hf_name])
        for (m, hf_names), kind in zip(_QKV, ("weight", "bias")):
            result[ours + m] = torch.cat([take(theirs + n, (rows, h) if kind == "weight" else (rows,))
                                          for n, rows in zip(hf_names, (q, kv, kv))])
        gate_up, gate_up_bias, down, down_bias = (
            take(theirs + "mlp.experts." + name, shape) for name, shape in zip(
                _EXPERTS, ((e, h, 2 * f), (e, 2 * f), (e, f, h), (e, h))))
        fc1 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=2).transpose(1, 2)   # [E, 2f, h]
        fc1_bias = torch.cat([gate_up_bias[:, ::2], gate_up_bias[:, 1::2]], dim=1)
        for j in range(e):
            result.update({f"{ours}mlp.experts.{j}.linear_fc1.weight": fc1[j],
                           f"{ours}mlp.experts.{j}.linear_fc1.bias": fc1_bias[j],
                           f"{ours}mlp.experts.{j}.linear_fc2.weight": down[j].t(),
                           f"{ours}mlp.experts.{j}.linear_fc2.bias": down_bias[j]})
    if named:
        raise CheckpointError(f"unexpected tensor {sorted(named)[0]} for {ARCHITECTURE}")
    return {name: t.contiguous() for name, t in result.items()}


# ---- config ---------------------------------------------------------------------------------------------------------

def _windows(hf: dict[str, Any]) -> dict[str, Any]:
    """megalite's window options of gpt-oss' sliding window W (the query and W - 1 before it) on its sliding layers."""
    layers = hf["num_hidden_layers"]
    layer_types = hf["layer_types"] or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != layers:
        raise CheckpointError(f"layer_types {unknown[0] if unknown else layer_types!r} is not supported")
    windowed = [kind == "sliding_attention" for kind in layer_types]
    window = hf["sliding_window"]
    if window is None or window >= hf["max_position_embeddings"] or not any(windowed):
        return {}
    if window < 1:
        raise CheckpointError(f"sliding_window {window} is not supported (a query sees at least itself)")
    skip = None if all(windowed) else "[" + ",".join(str(int(w)) for w in windowed) + "]"
    return {"window_size": f"{window - 1},0", "window_attn_skip_freq": skip}


def model_config_from(hf: dict[str, Any]) -> ModelConfig:
    """The megalite ModelConfig of a GptOss config.json (refusing what megalite would compute differently)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"model_type {hf.get('model_type')!r}: not {MODEL_TYPE}")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?") if isinstance(
            hf["quantization_config"], dict) else "?"
        raise CheckpointError(f"quantization_config ({method}) is not supported: dequantize the experts first "
                              f"(transformers' Mxfp4Config(dequantize=True), then save_pretrained)")
    if "rope_parameters" not in hf and "rope_scaling" not in hf:
        hf = {**hf, "rope_scaling": _HF_DEFAULTS["rope_scaling"]}
    hf = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "sliding_window"}}
    if hf["swiglu_alpha"] != QUICK_GELU_ALPHA:
        raise CheckpointError(f"swiglu_alpha {hf['swiglu_alpha']} is not supported (megalite's quick GeGLU uses "
                              f"sigmoid({QUICK_GELU_ALPHA} x))")
    if not hf["attention_bias"]:
        raise CheckpointError("attention_bias false is not supported (megalite's gpt-oss has the experts' biases "
                              "with the attention's)")
    if hf["swiglu_limit"] is None or hf["swiglu_limit"] <= 0:
        raise CheckpointError(f"swiglu_limit {hf['swiglu_limit']} is not supported (a positive clamp)")
    rope = hf_llama._rope(hf)
    hidden, heads, head_dim = hf["hidden_size"], hf["num_attention_heads"], hf["head_dim"]
    groups = hf["num_key_value_heads"] or heads
    positions = hf["max_position_embeddings"]
    return ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads, kv_channels=head_dim if head_dim * heads != hidden else None,
        seq_length=positions, max_position_embeddings=positions, vocab_size=hf["vocab_size"],
        init_method_std=hf["initializer_range"], hidden_dropout=0.0, attention_dropout=hf["attention_dropout"],
        layernorm_epsilon=hf["rms_norm_eps"], untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
        position_embedding_type="rope", normalization="RMSNorm", quick_geglu=True, glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf["swiglu_limit"]), softmax_type="learnable",
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else 1,
        num_experts=hf["num_local_experts"], moe_ffn_hidden_size=hf["intermediate_size"],
        moe_router_topk=hf["num_experts_per_tok"], moe_aux_loss_coeff=float(hf["router_aux_loss_coef"]),
        **_windows(hf), **rope)


def hf_config_from(model: ModelConfig, eod: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The keyword arguments of transformers' GptOssConfig equal to a megalite gpt-oss."""
    config = hf_llama.hf_config_from(model, eod, dtype)
    for key in ("mlp_bias",):
        config.pop(key, None)
    windows = model.attention_windows()
    window = next((w + 1 for w in windows if w is not None), None)   # HF counts the query itself
    config.update(architectures=[ARCHITECTURE], intermediate_size=model.expert_ffn_size, head_dim=model.head_dim,
                  num_local_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk,
                  router_aux_loss_coef=model.moe_aux_loss_coeff, attention_bias=True,
                  swiglu_alpha=QUICK_GELU_ALPHA, swiglu_limit=model.activation_func_clamp_value,
                  sliding_window=window,
                  layer_types=["full_attention" if w is None else "sliding_attention" for w in windows])
    if not model.use_rope_scaling:   # GptOssConfig's default is yarn: say plainly that there is none
        config["rope_scaling"] = {"rope_type": "default"}
    return config


def write_hf_config(model: ModelConfig, directory: str | os.PathLike, eod: int | None = None,
                    dtype: torch.dtype = torch.float32) -> None:
    """Write ``directory/config.json`` with transformers' GptOssConfig."""
    hf_llama.save_config("GptOssConfig", ARCHITECTURE, hf_config_from(model, eod, dtype), directory)
