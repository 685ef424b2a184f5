"""Megalite's GPT <-> Hugging Face ``GPT2LMHeadModel``: names, shapes and config, as pure functions.

The two are the same network: learned positions, pre-LayerNorm blocks, biases everywhere but the output layer,
1/sqrt(head dim) attention scaling, heads laid out the same way inside q, k and v. Differences handled here:

- HF GPT-2 uses ``Conv1D`` (weight [in, out]) where megalite uses linear layers (weight [out, in]): transposed.
- ``c_attn`` is the fused [q; k; v] projection, megalite's canonical ``linear_qkv`` stacked the same way.
- the activation: HF ``activation_function="gelu"`` is megalite's exact GeLU; ``gelu_new`` (OpenAI's GPT-2, HF's
  default), ``gelu_pytorch_tanh`` and ``gelu_fast`` are its tanh approximation, megalite's ``--openai-gelu``; any
  other is refused. An export writes ``gelu`` or ``gelu_new``.
- canonical tensors carry no vocabulary padding, so the HF vocabulary is the tokenizer's.

No ``transformers`` import: config.json is plain JSON, and the tensors are given and returned as dicts.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.model_specs import check_options_mapped
from megalite.config import ModelConfig

ARCHITECTURE = "GPT2LMHeadModel"
EXACT_GELU = "gelu"
TANH_GELU = "gelu_new"
TANH_GELUS = (TANH_GELU, "gelu_pytorch_tanh", "gelu_fast")   # the same function, written three ways

# GPT2Config's defaults, for config.json files that leave keys out.
_HF_DEFAULTS = {"n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
                "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
                "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False, "tie_word_embeddings": True,
                "vocab_size": 50257}

# The model-defining options (MODEL_DEFINING) the GPT-2 mapping accounts for; any other (rotary positions, RMSNorm,
# SwiGLU, ...) must keep its default to be exported.
_MAPPED_FIELDS = {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings",
                  "vocab_size", "layernorm_epsilon", "untie_embeddings_and_output_weights", "openai_gelu"}

_LAYER_NAMES = [  # (megalite name inside layer i, HF name inside block i, transposed)
    ("input_norm.weight", "ln_1.weight", False), ("input_norm.bias", "ln_1.bias", False),
    ("self_attention.linear_qkv.weight", "attn.c_attn.weight", True),
    ("self_attention.linear_qkv.bias", "attn.c_attn.bias", False),
    ("self_attention.linear_proj.weight", "attn.c_proj.weight", True),
    ("self_attention.linear_proj.bias", "attn.c_proj.bias", False),
    ("pre_mlp_norm.weight", "ln_2.weight", False), ("pre_mlp_norm.bias", "ln_2.bias", False),
    ("mlp.linear_fc1.weight", "mlp.c_fc.weight", True), ("mlp.linear_fc1.bias", "mlp.c_fc.bias", False),
    ("mlp.linear_fc2.weight", "mlp.c_proj.weight", True), ("mlp.linear_fc2.bias", "mlp.c_proj.bias", False),
]
_TOP_NAMES = [("embedding.word.weight", "transformer.wte.weight"),
              ("embedding.position.weight", "transformer.wpe.weight"),
              ("final_norm.weight", "transformer.ln_f.weight"), ("final_norm.bias", "transformer.ln_f.bias")]
# Buffers older HF checkpoints store beside the parameters (the causal mask): not weights, ignored on import.
_HF_BUFFERS = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")


def name_map(model: ModelConfig) -> list[tuple[str, str, bool]]:
    """(canonical megalite name, HF name, transposed) for every tensor of a GPT-2 with this config."""
    names = [(m, h, False) for m, h in _TOP_NAMES]
    for i in range(model.num_layers):
        names += [(f"layers.{i}.{m}", f"transformer.h.{i}.{h}", t) for m, h, t in _LAYER_NAMES]
    if model.untie_embeddings_and_output_weights:
        names.append(("output_layer.weight", "lm_head.weight", False))
    return names


def check_exportable(model: ModelConfig) -> None:
    """Raise CheckpointError if the model uses an option GPT-2 has no counterpart for."""
    check_options_mapped(model, _MAPPED_FIELDS, ARCHITECTURE, "GPT-2")


def to_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical megalite tensors -> HF GPT-2 state dict (names, Conv1D transposes); checks every shape."""
    check_exportable(model)
    expected = name_map(model)
    known = {m for m, _, _ in expected}
    extra = sorted(set(tensors) - known)
    if extra:
        raise CheckpointError(f"cannot export as {ARCHITECTURE}: it has no counterpart of {extra[0]}")
    result = {}
    for megalite_name, hf_name, transposed in expected:
        if megalite_name not in tensors:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: the checkpoint has no {megalite_name}")
        tensor = tensors[megalite_name]
        result[hf_name] = (tensor.t() if transposed else tensor).contiguous()
    _check_shapes(result, hf_config_from(model), "exported")
    return result


def from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 state dict (with or without the ``transformer.`` prefix) -> canonical megalite tensors, for the
    model :func:`model_config_from` made of its config."""
    named = {}
    for name, tensor in tensors.items():
        if _HF_BUFFERS.fullmatch(name):
            continue
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name   # a GPT2Model's state dict
        named[name] = tensor
    if not model.untie_embeddings_and_output_weights:
        named.pop("lm_head.weight", None)   # tied: the same tensor as wte, when it is stored at all
    _check_shapes(named, hf_config_from(model), "input")
    expected = name_map(model)
    unexpected = sorted(set(named) - {h for _, h, _ in expected})
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} for {ARCHITECTURE}")
    return {m: (named[h].t() if transposed else named[h]).contiguous() for m, h, transposed in expected}


def _check_shapes(tensors: dict[str, torch.Tensor], hf: dict[str, Any], what: str) -> None:
    h, v, p = hf["n_embd"], hf["vocab_size"], hf["n_positions"]
    ffn = hf["n_inner"] or 4 * h
    shapes = {"wte.weight": (v, h), "wpe.weight": (p, h), "ln_f.weight": (h,), "ln_f.bias": (h,),
              "ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
              "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,), "attn.c_proj.weight": (h, h),
              "attn.c_proj.bias": (h,), "mlp.c_fc.weight": (h, ffn), "mlp.c_fc.bias": (ffn,),
              "mlp.c_proj.weight": (ffn, h), "mlp.c_proj.bias": (h,), "lm_head.weight": (v, h)}
    for layer in range(hf["n_layer"]):
        for suffix in ("ln_1.weight", "attn.c_attn.weight", "mlp.c_fc.weight"):   # presence of each block
            if f"transformer.h.{layer}.{suffix}" not in tensors:
                raise CheckpointError(f"{what} has no transformer.h.{layer}.{suffix}")
    for name, tensor in tensors.items():
        suffix = re.sub(r"^(transformer\.)?(h\.\d+\.)?", "", name)
        want = shapes.get(suffix)
        if want is not None and tuple(tensor.shape) != want:
            raise CheckpointError(f"{what} tensor {name} is {list(tensor.shape)}, the config says {list(want)}")


def _with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    return {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "n_inner"}}


def model_config_from(hf: dict[str, Any]) -> ModelConfig:
    """The megalite ModelConfig of an HF GPT-2 config.json (refusing what megalite would compute differently)."""
    hf = _with_defaults(hf)
    if hf.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"model_type {hf.get('model_type')!r}: only {ARCHITECTURE} (gpt2) can be imported")
    activation = hf["activation_function"]
    if activation != EXACT_GELU and activation not in TANH_GELUS:
        raise CheckpointError(f"activation_function {activation!r} is not supported (megalite computes GeLU, "
                              f"exact ({EXACT_GELU}) or tanh ({', '.join(TANH_GELUS)}))")
    for key, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("add_cross_attention", False)):
        if bool(hf[key]) != supported:
            raise CheckpointError(f"{key}={hf[key]} is not supported (megalite computes {key}={supported})")
    return ModelConfig(num_layers=hf["n_layer"], hidden_size=hf["n_embd"], ffn_hidden_size=hf["n_inner"],
                       num_attention_heads=hf["n_head"], seq_length=hf["n_positions"],
                       max_position_embeddings=hf["n_positions"], vocab_size=hf["vocab_size"],
                       init_method_std=hf["initializer_range"], hidden_dropout=hf["resid_pdrop"],
                       attention_dropout=hf["attn_pdrop"], layernorm_epsilon=hf["layer_norm_epsilon"],
                       untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
                       openai_gelu=activation in TANH_GELUS)


def hf_config_from(model: ModelConfig, eod: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json of the GPT2LMHeadModel equal to a megalite model."""
    config = {"architectures": [ARCHITECTURE], "model_type": "gpt2", "vocab_size": model.vocab_size,
              "n_positions": model.max_positions, "n_embd": model.hidden_size, "n_layer": model.num_layers,
              "n_head": model.num_attention_heads, "n_inner": model.ffn_size,
              "activation_function": TANH_GELU if model.openai_gelu else EXACT_GELU,
              "resid_pdrop": model.hidden_dropout, "embd_pdrop": model.hidden_dropout,
              "attn_pdrop": model.attention_dropout, "layer_norm_epsilon": model.layernorm_epsilon,
              "initializer_range": model.init_method_std, "scale_attn_weights": True,
              "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
              "add_cross_attention": False, "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
              "use_cache": True, "bos_token_id": eod, "eos_token_id": eod,
              "torch_dtype": str(dtype).removeprefix("torch.")}
    return config
