"""Megalite's Gemma-3-shaped GPT <-> Hugging Face ``Gemma3ForCausalLM`` (config.json's ``model_type`` gemma3_text,
the text model of Gemma 3): names, shapes and config.

A Gemma 3 is a Llama-shaped model (rotary positions, RMSNorm, no biases, grouped-query attention, a head dimension
of its own: ``--kv-channels``) with these options, each of which it must have to export and gets on import:

- every RMSNorm zero-centred, 1 + w computed in fp32 (``--apply-layernorm-1p``: HF stores the same w, so norm
  weights copy as they are), per-head q/k norms (``--qk-layernorm``) and sandwich norms (``--sandwich-norm``: HF's
  ``post_attention_layernorm`` and ``post_feedforward_layernorm`` are megalite's post-attention and post-MLP norms,
  HF's ``pre_feedforward_layernorm`` megalite's ``pre_mlp_norm``);
- GeGLU (``--gated-linear-unit``; ``hidden_activation`` gelu_pytorch_tanh is ``--openai-gelu``, gelu the exact one);
- word embeddings times sqrt(hidden size) (``--scale-embeddings``);
- the attention scores scaled by ``query_pre_attn_scalar``^-0.5 (``--softmax-scale``);
- sliding-window layers (``layer_types``' sliding_attention, or every ``sliding_window_pattern``-th layer global):
  HF's ``sliding_window`` W is ``--window-size W-1,0`` with the ``--window-attn-skip-freq`` pattern, kept even where
  W covers the context, as those layers rotate with their own base: ``rope_local_base_freq``, never scaled
  (``--local-rotary-base``); the global layers use ``rope_theta`` and the rope scaling (linear in Gemma 3).

Refused by name: logit softcapping (``attn_logit_softcapping``, ``final_logit_softcapping``: none in Gemma 3),
bidirectional attention, attention biases, another activation, rope scaling of the sliding layers. Tensors are
renamed and fused ones cut as for Llama (``hf_llama``); config.json is written by transformers' own
``Gemma3TextConfig``, and read as plain JSON in either format (v5's ``rope_parameters`` per layer type, or
``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` before).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megalite.checkpoint import hf_llama
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.model_specs import check_options_mapped
from megalite.config import ModelConfig

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
# hidden_activation -> --openai-gelu
ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu": False}

# The options that make a megalite model a Gemma 3, with the value each must have.
GEMMA3_OPTIONS = {"position_embedding_type": "rope", "normalization": "RMSNorm", "apply_layernorm_1p": True,
                  "qk_layernorm": True, "sandwich_norm": True, "scale_embeddings": True, "gated_linear_unit": True,
                  "disable_bias_linear": True}
_MAPPED_FIELDS = {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings",
                  "vocab_size", "layernorm_epsilon", "untie_embeddings_and_output_weights", "rotary_base",
                  "local_rotary_base", "use_rope_scaling", "rope_scaling_type", "rope_scaling_factor",
                  "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                  "rope_scaling_original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                  "mscale_all_dim", "rope_scaling_attention_factor", "group_query_attention", "num_query_groups",
                  "kv_channels", "openai_gelu", "softmax_scale", "window_size", "window_attn_skip_freq",
                  "no_position_embedding", *GEMMA3_OPTIONS}

# Gemma3TextConfig's defaults, for config.json files that leave keys out.
DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "initializer_range": 0.02,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0, "rope_scaling": None, "rope_parameters": None,
            "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "sliding_window_pattern": 6, "layer_types": None,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False}

# (megalite name inside layer i, HF names inside model.layers.i it is the stack of, in order)
_LAYER_NAMES = [("input_norm.weight", ["input_layernorm.weight"]),
                ("self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"]),
                ("self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"]),
                ("self_attention.linear_qkv.weight",
                 ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]),
                ("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"]),
                ("post_attention_norm.weight", ["post_attention_layernorm.weight"]),
                ("pre_mlp_norm.weight", ["pre_feedforward_layernorm.weight"]),
                ("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
                ("mlp.linear_fc2.weight", ["mlp.down_proj.weight"]),
                ("post_mlp_norm.weight", ["post_feedforward_layernorm.weight"])]
_TOP_NAMES = [("embedding.word.weight", ["model.embed_tokens.weight"]), ("final_norm.weight", ["model.norm.weight"])]


def is_gemma_shaped(model: ModelConfig) -> bool:
    """Whether the model uses an option only Gemma 3 has among the families exported (then it exports as one; its
    zero-centred norms and softmax scale alone make no Gemma: other families refuse them by name)."""
    return (model.sandwich_norm or model.scale_embeddings or model.gated_linear_unit
            or model.local_rotary_base is not None)


def name_map(model: ModelConfig) -> list[tuple[str, list[str]]]:
    """(canonical megalite name, the HF names it stacks along dim 0) for every tensor of a Gemma 3 of this config."""
    names = list(_TOP_NAMES)
    for i in range(model.num_layers):
        names += [(f"layers.{i}.{m}", [f"model.layers.{i}.{h}" for h in hf]) for m, hf in _LAYER_NAMES]
    if model.untie_embeddings_and_output_weights:
        names.append(("output_layer.weight", ["lm_head.weight"]))
    return names


def _shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor's shape, by its name inside the model or a layer (Llama's, plus the sandwich norms)."""
    h = model.hidden_size
    return {**hf_llama._hf_shapes(model), "pre_feedforward_layernorm.weight": (h,),
            "post_feedforward_layernorm.weight": (h,)}


def check_exportable(model: ModelConfig) -> None:
    """Raise CheckpointError unless the model is a Gemma 3: every Gemma 3 option set, every other option mapped."""
    for name, wanted in GEMMA3_OPTIONS.items():
        if getattr(model, name) != wanted:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: model option {name}={getattr(model, name)!r} (a "
                                  f"Gemma 3 needs {name}={wanted!r})")
    windowed = any(w is not None for w in model.attention_windows())
    if windowed and model.use_rope_scaling and model.local_rotary_base is None:
        raise CheckpointError(f"cannot export as {ARCHITECTURE}: its sliding layers' rope would be scaled too (Gemma "
                              f"3 scales the global layers' only: set local_rotary_base)")
    if model.softmax_scale is not None:
        _query_pre_attn_scalar(model)
    check_options_mapped(model, _MAPPED_FIELDS, ARCHITECTURE, "Gemma 3")


def _query_pre_attn_scalar(model: ModelConfig) -> int:
    """HF's integer query_pre_attn_scalar q with q^-0.5 the model's softmax scale (by default the head dimension)."""
    if model.softmax_scale is None:
        return model.head_dim
    scalar = round(model.softmax_scale ** -2)
    if scalar < 1 or scalar ** -0.5 != model.softmax_scale:
        raise CheckpointError(f"cannot export as {ARCHITECTURE}: softmax_scale {model.softmax_scale} is not "
                              f"query_pre_attn_scalar^-0.5 of an integer query_pre_attn_scalar")
    return scalar


def to_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical megalite tensors -> HF state dict (names, fused weights cut); checks every shape."""
    check_exportable(model)
    expected = name_map(model)
    extra = sorted(set(tensors) - {m for m, _ in expected})
    if extra:
        raise CheckpointError(f"cannot export as {ARCHITECTURE}: it has no counterpart of {extra[0]}")
    shapes, result = _shapes(model), {}
    for megalite_name, hf_names in expected:
        if megalite_name not in tensors:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: the checkpoint has no {megalite_name}")
        tensor = tensors[megalite_name]
        rows = [shapes[hf_llama._suffix(h)][0] for h in hf_names]
        if tensor.shape[0] != sum(rows):
            raise CheckpointError(f"{megalite_name} is {list(tensor.shape)}, the config says {sum(rows)} rows")
        result.update({h: block.contiguous() for h, block in zip(hf_names, tensor.split(rows), strict=True)})
    _check_shapes(result, model, "exported")
    return result


def from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict (with or without the ``model.`` prefix) -> canonical megalite tensors."""
    named = hf_llama.hf_state_dict(tensors, model)
    expected = name_map(model)
    hf_llama.check_names(named, expected, ARCHITECTURE)
    _check_shapes(named, model, "input")
    return {m: torch.cat([named[h] for h in hf_names]).contiguous() for m, hf_names in expected}


def _check_shapes(tensors: dict[str, torch.Tensor], model: ModelConfig, what: str) -> None:
    shapes = _shapes(model)
    for name, tensor in tensors.items():
        want = shapes.get(hf_llama._suffix(name))
        if want is not None and tuple(tensor.shape) != want:
            raise CheckpointError(f"{what} tensor {name} is {list(tensor.shape)}, the config says {list(want)}")


def _rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The global layers' rotary options (base, scaling) and the sliding layers' base, of either config format."""
    parameters = hf["rope_parameters"] or {}
    full = parameters.get("full_attention") or {}
    sliding = dict(parameters.get("sliding_attention") or {})
    if parameters and not set(parameters) <= {"full_attention", "sliding_attention"}:
        full = parameters   # one set of rope parameters for every layer (transformers' other models' format)
    options = hf_llama._rope({"rope_parameters": full, "rope_scaling": hf["rope_scaling"],
                              "rope_theta": hf["rope_theta"], "max_position_embeddings": hf["max_position_embeddings"],
                              "original_max_position_embeddings": hf.get("original_max_position_embeddings")})
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise CheckpointError(f"rope scaling {sliding.get('rope_type', sliding.get('type'))!r} of the "
                              f"sliding_attention layers is not supported (megalite scales the global layers' only)")
    local = sliding.get("rope_theta") or hf["rope_local_base_freq"]
    if float(local) != int(local):
        raise CheckpointError(f"rope_local_base_freq {local} is not supported (megalite's rotary base is an integer)")
    return options, int(local)


def _layer_windows(hf: dict[str, Any]) -> dict[str, Any]:
    """megalite's window options of HF's layer types and sliding window (W: the query and the W - 1 before it)."""
    layers = hf["num_hidden_layers"]
    layer_types = hf["layer_types"] or ["sliding_attention" if (i + 1) % hf["sliding_window_pattern"] else
                                        "full_attention" for i in range(layers)]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise CheckpointError(f"layer_types {unknown[0]!r} is not supported")
    if len(layer_types) != layers:
        raise CheckpointError(f"layer_types has {len(layer_types)} entries for {layers} layers")
    windowed = [kind == "sliding_attention" for kind in layer_types]
    if not any(windowed):
        return {}
    window = hf["sliding_window"]
    if window is None or window < 1:
        raise CheckpointError(f"sliding_window {window} is not supported (a query sees at least itself)")
    return {"window_size": f"{window - 1},0", "window_attn_skip_freq": _skip_freq(windowed)}


def _skip_freq(windowed: list[bool]) -> str | None:
    """--window-attn-skip-freq of per-layer windows: none (all windowed), N where every N-th layer is global
    (Gemma 3's sliding_window_pattern), else the 0/1 pattern."""
    if all(windowed):
        return None
    every = windowed.index(False) + 1
    if windowed == [(i + 1) % every != 0 for i in range(len(windowed))]:
        return str(every)
    return "[" + ",".join(str(int(w)) for w in windowed) + "]"


def model_config_from(hf: dict[str, Any]) -> ModelConfig:
    """The megalite ModelConfig of an HF Gemma 3 text config.json (refusing what megalite would compute
    differently)."""
    hf = {**DEFAULTS, **hf}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf[key] is not None:
            raise CheckpointError(f"{key} {hf[key]} is not supported (megalite applies no logit softcapping; Gemma 3 "
                                  f"has none)")
    if hf["use_bidirectional_attention"]:
        raise CheckpointError("use_bidirectional_attention is not supported (megalite's attention is causal)")
    if hf["attention_bias"]:
        raise CheckpointError(f"attention_bias={hf['attention_bias']} is not supported (Gemma 3 has no biases)")
    if hf["hidden_activation"] not in ACTIVATIONS:
        raise CheckpointError(f"hidden_activation {hf['hidden_activation']!r} is not supported (megalite's GeGLU "
                              f"uses {' or '.join(ACTIVATIONS)})")
    rope, local_base = _rope(hf)
    windows = _layer_windows(hf)
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf["head_dim"] or hidden // heads
    groups = hf["num_key_value_heads"] or heads
    scalar = hf["query_pre_attn_scalar"]
    return ModelConfig(num_layers=hf["num_hidden_layers"], hidden_size=hidden, ffn_hidden_size=hf["intermediate_size"],
                       num_attention_heads=heads, seq_length=hf["max_position_embeddings"],
                       max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                       init_method_std=hf["initializer_range"], hidden_dropout=0.0,
                       attention_dropout=hf["attention_dropout"], layernorm_epsilon=hf["rms_norm_eps"],
                       untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
                       openai_gelu=ACTIVATIONS[hf["hidden_activation"]],
                       group_query_attention=groups != heads, num_query_groups=groups if groups != heads else 1,
                       kv_channels=head_dim if head_dim * heads != hidden else None,
                       softmax_scale=float(scalar) ** -0.5,   # as transformers: query_pre_attn_scalar**-0.5
                       local_rotary_base=local_base if windows else None, **GEMMA3_OPTIONS, **windows, **rope)


def hf_config_from(model: ModelConfig, eod: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The keyword arguments of Gemma3TextConfig equal to a megalite model."""
    windows = model.attention_windows()
    window = next((w + 1 for w in windows if w is not None), None)   # HF counts the query itself
    config = {"architectures": [ARCHITECTURE], "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
              "intermediate_size": model.ffn_size, "num_hidden_layers": model.num_layers,
              "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.query_groups,
              "head_dim": model.head_dim, "hidden_activation": "gelu_pytorch_tanh" if model.openai_gelu else "gelu",
              "max_position_embeddings": model.max_positions, "initializer_range": model.init_method_std,
              "rms_norm_eps": model.layernorm_epsilon,
              "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
              "rope_theta": float(model.rotary_base),
              "rope_local_base_freq": float(model.local_rotary_base or model.rotary_base),
              "attention_bias": False, "attention_dropout": model.attention_dropout,
              "query_pre_attn_scalar": _query_pre_attn_scalar(model), "sliding_window": window,
              "layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows],
              "final_logit_softcapping": None, "attn_logit_softcapping": None,
              "bos_token_id": eod, "eos_token_id": eod, "dtype": str(dtype).removeprefix("torch.")}
    if model.use_rope_scaling:
        config["rope_scaling"] = hf_llama._rope_scaling(model)
    return config


def write_hf_config(model: ModelConfig, directory: str | os.PathLike, eod: int | None = None,
                    dtype: torch.dtype = torch.float32) -> None:
    """Write ``directory/config.json`` with transformers' Gemma3TextConfig (the only use of transformers here)."""
    hf_llama.save_config("Gemma3TextConfig", ARCHITECTURE, hf_config_from(model, eod, dtype), directory)
