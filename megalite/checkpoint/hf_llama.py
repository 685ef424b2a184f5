"""Megalite's Llama-shaped GPT <-> Hugging Face ``LlamaForCausalLM``: names, shapes and config.

A megalite model with rotary positions, RMSNorm, SwiGLU and no biases (grouped-query attention or not) is a Llama.
Its canonical tensors are already in Hugging Face's layout, so converting is renaming and cutting fused weights:

- ``linear_qkv`` is [q_proj; k_proj; v_proj] stacked along the output dimension, q with heads x head_dim rows, k
  and v with groups x head_dim rows each, heads in order inside each block (no per-group interleaving: tensor
  parallelism splits each block separately, so the canonical tensor is the plain stack).
- ``linear_fc1`` is [gate_proj; up_proj]; ``linear_proj`` is o_proj, ``linear_fc2`` down_proj; no transposes.
- Rotary embeddings use the rotate-half convention of HF's Llama, whose q_proj/k_proj rows are already permuted for
  it (Meta's original checkpoints are not): no permutation either way.
- Canonical tensors carry no vocabulary padding, so the HF vocabulary is the tokenizer's.

What megalite would compute differently is refused by name: rope scaling (Llama 3.1's ``llama3``, ``linear``,
``dynamic``, ...), attention or MLP biases, an activation other than SiLU. A ``head_dim`` other than hidden size /
heads is megalite's ``--kv-channels``. HF's Llama has no hidden dropout: megalite's (training only) is not exported and is 0 on import.

config.json is written by transformers' own ``LlamaConfig`` (imported only then), so it is in the format the
installed transformers reads (``rope_parameters`` from v5, ``rope_theta`` before); importing reads plain JSON in
either format, with LlamaConfig's defaults for missing keys, and needs no transformers.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.model_specs import check_options_mapped
from megalite.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
SILU = ("silu", "swish")   # the same function in transformers' ACT2FN

# The options that make a megalite model a Llama, with the value each must have.
LLAMA_OPTIONS = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
                 "disable_bias_linear": True}

# ModelConfig fields the Llama mapping accounts for, or that change neither the weights nor the inference maths
# (activation recompute, hidden dropout); any other field must keep its default to be exported.
_MAPPED_FIELDS = {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
                  "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by", "init_method_std",
                  "hidden_dropout", "attention_dropout", "layernorm_epsilon", "untie_embeddings_and_output_weights",
                  "rotary_base", "group_query_attention", "num_query_groups", "recompute_granularity",
                  "recompute_method", "recompute_num_layers", "kv_channels", *LLAMA_OPTIONS,
                  "no_position_embedding"}   # HF's head_dim; no learned positions beside rope anyway

# LlamaConfig's defaults, for config.json files that leave keys out (None: derived from other keys).
_HF_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
                "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
                "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None}

# (megalite name inside layer i, HF names inside model.layers.i it is the stack of, in order)
_LAYER_NAMES = [("input_norm.weight", ["input_layernorm.weight"]),
                ("self_attention.linear_qkv.weight",
                 ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]),
                ("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"]),
                ("pre_mlp_norm.weight", ["post_attention_layernorm.weight"]),
                ("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
                ("mlp.linear_fc2.weight", ["mlp.down_proj.weight"])]
_TOP_NAMES = [("embedding.word.weight", ["model.embed_tokens.weight"]), ("final_norm.weight", ["model.norm.weight"])]
# Buffers some HF versions store beside the parameters (rotary inverse frequencies): not weights, ignored on import.
_HF_BUFFERS = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def is_llama_shaped(model: ModelConfig) -> bool:
    """Whether the model uses any Llama-only option (then it can only export as a Llama, if at all)."""
    return model.group_query_attention or any(getattr(model, k) == v for k, v in LLAMA_OPTIONS.items())


def name_map(model: ModelConfig) -> list[tuple[str, list[str]]]:
    """(canonical megalite name, the HF names it stacks along dim 0) for every tensor of a Llama with this config."""
    names = list(_TOP_NAMES)
    for i in range(model.num_layers):
        names += [(f"layers.{i}.{m}", [f"model.layers.{i}.{h}" for h in hf]) for m, hf in _LAYER_NAMES]
    if model.untie_embeddings_and_output_weights:
        names.append(("output_layer.weight", ["lm_head.weight"]))
    return names


def check_exportable(model: ModelConfig) -> None:
    """Raise CheckpointError unless the model is a Llama: every Llama option set, every other option mapped."""
    for name, wanted in LLAMA_OPTIONS.items():
        value = getattr(model, name)
        if value != wanted:
            raise CheckpointError(
                f"cannot export as {ARCHITECTURE}: model option {name}={value!r} (a Llama needs {name}={wanted!r}); "
                f"a GPT-2-shaped model (learned positions, LayerNorm, GeLU, biases) exports as GPT2LMHeadModel")
    check_options_mapped(model, _MAPPED_FIELDS, ARCHITECTURE, "Llama")


def to_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical megalite tensors -> HF Llama state dict (names, fused weights cut); checks every shape."""
    check_exportable(model)
    expected = name_map(model)
    extra = sorted(set(tensors) - {m for m, _ in expected})
    if extra:
        raise CheckpointError(f"cannot export as {ARCHITECTURE}: it has no counterpart of {extra[0]}")
    shapes = _hf_shapes(model)
    result = {}
    for megalite_name, hf_names in expected:
        if megalite_name not in tensors:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: the checkpoint has no {megalite_name}")
        tensor = tensors[megalite_name]
        rows = [shapes[_suffix(h)][0] for h in hf_names]   # a fused tensor's blocks, in stacking order
        if tensor.shape[0] != sum(rows):
            raise CheckpointError(f"{megalite_name} is {list(tensor.shape)}, the config says {sum(rows)} rows")
        result.update({h: block.contiguous() for h, block in zip(hf_names, tensor.split(rows), strict=True)})
    _check_shapes(result, model, "exported")
    return result


def from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Llama state dict (with or without the ``model.`` prefix) -> canonical megalite tensors, for the model
    :func:`model_config_from` made of its config."""
    named = {}
    for name, tensor in tensors.items():
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name   # a LlamaModel's state dict
        if not _HF_BUFFERS.fullmatch(name):
            named[name] = tensor
    if not model.untie_embeddings_and_output_weights:
        named.pop("lm_head.weight", None)   # tied: the same tensor as embed_tokens, when it is stored at all
    expected = name_map(model)
    missing = [h for _, hf_names in expected for h in hf_names if h not in named]
    if missing:
        raise CheckpointError(f"input has no {missing[0]}" + (
            " (the config says tie_word_embeddings=false)" if missing[0] == "lm_head.weight" else ""))
    unexpected = sorted(set(named) - {h for _, hf_names in expected for h in hf_names})
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} for {ARCHITECTURE}")
    _check_shapes(named, model, "input")
    return {m: torch.cat([named[h] for h in hf_names]).contiguous() for m, hf_names in expected}


def _suffix(hf_name: str) -> str:
    """The name inside a block (or the model): ``model.layers.3.mlp.up_proj.weight`` -> ``mlp.up_proj.weight``."""
    return re.sub(r"^(model\.)?(layers\.\d+\.)?", "", hf_name)


def _hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor, by :func:`_suffix`."""
    h, v, ffn = model.hidden_size, model.vocab_size, model.ffn_size
    q, kv = model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    return {"embed_tokens.weight": (v, h), "norm.weight": (h,), "lm_head.weight": (v, h),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h),
            "mlp.down_proj.weight": (h, ffn)}


def _check_shapes(tensors: dict[str, torch.Tensor], model: ModelConfig, what: str) -> None:
    shapes = _hf_shapes(model)
    for name, tensor in tensors.items():
        want = shapes.get(_suffix(name))
        if want is not None and tuple(tensor.shape) != want:
            raise CheckpointError(f"{what} tensor {name} is {list(tensor.shape)}, the config says {list(want)}")


def _rope_theta(hf: dict[str, Any]) -> float:
    """The rotary base of either config format, refusing any rope scaling."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}   # v5 / before v5
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"rope scaling {kind!r} is not supported (megalite computes plain rotary embeddings): "
                              f"rope_scaling/rope_parameters must be unset or of rope_type 'default'")
    theta = rope.get("rope_theta", hf["rope_theta"])
    if float(theta) != int(theta):
        raise CheckpointError(f"rope_theta {theta} is not supported (megalite's rotary base is an integer)")
    return theta


def model_config_from(hf: dict[str, Any]) -> ModelConfig:
    """The megalite ModelConfig of an HF Llama config.json (refusing what megalite would compute differently)."""
    if hf.get("model_type") != "llama":
        raise CheckpointError(f"model_type {hf.get('model_type')!r}: not a {ARCHITECTURE} (llama)")
    hf = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    theta = _rope_theta(hf)
    if hf["hidden_act"] not in SILU:
        raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (megalite's SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf[key]:
            raise CheckpointError(f"{key}={hf[key]} is not supported (megalite's Llama has no biases)")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    # head_dim other than hidden / heads (Qwen3-style): megalite's --kv-channels.
    kv_channels = hf["head_dim"] if hf["head_dim"] is not None and hf["head_dim"] * heads != hidden else None
    if kv_channels is None and hidden % heads:
        raise CheckpointError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    groups = hf["num_key_value_heads"] or heads
    grouped = groups != heads
    return ModelConfig(num_layers=hf["num_hidden_layers"], hidden_size=hidden,
                       ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
                       seq_length=hf["max_position_embeddings"],
                       max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                       init_method_std=hf["initializer_range"], hidden_dropout=0.0,
                       attention_dropout=hf["attention_dropout"], layernorm_epsilon=hf["rms_norm_eps"],
                       untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
                       position_embedding_type="rope", rotary_base=int(theta), normalization="RMSNorm",
                       swiglu=True, group_query_attention=grouped, num_query_groups=groups if grouped else 1,
                       disable_bias_linear=True, kv_channels=kv_channels)


def hf_config_from(model: ModelConfig, eod: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``LlamaConfig`` keyword arguments of the HF Llama equal to a megalite model."""
    return {"architectures": [ARCHITECTURE], "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
            "intermediate_size": model.ffn_size, "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.query_groups,
            "head_dim": model.head_dim, "hidden_act": "silu", "max_position_embeddings": model.max_positions,
            "initializer_range": model.init_method_std, "rms_norm_eps": model.layernorm_epsilon,
            "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
            "rope_theta": float(model.rotary_base), "attention_bias": False, "mlp_bias": False,
            "attention_dropout": model.attention_dropout, "bos_token_id": eod, "eos_token_id": eod,
            "dtype": str(dtype).removeprefix("torch.")}


def write_hf_config(model: ModelConfig, directory: str | os.PathLike, eod: int | None = None,
                    dtype: torch.dtype = torch.float32) -> None:
    """Write ``directory/config.json`` with transformers' LlamaConfig (the only use of transformers here)."""
    try:
        from transformers import LlamaConfig
    except ImportError:
        raise CheckpointError(f"exporting as {ARCHITECTURE} needs the transformers package: "
                              f"pip install transformers") from None
    LlamaConfig(**hf_config_from(model, eod, dtype)).save_pretrained(directory)
