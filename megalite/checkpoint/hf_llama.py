"""Megalite's Llama-shaped GPT <-> Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``
and ``Qwen3ForCausalLM``: names, shapes and config.

A megalite model with rotary positions, RMSNorm, SwiGLU and no biases (grouped-query attention or not) is a Llama;
with ``--add-qkv-bias`` (biases on q, k and v only) a Qwen2; with ``--qk-layernorm`` (an RMSNorm over the head
dimension shared by every head, on q and k before rotary embeddings: Qwen3's ``q_norm``/``k_norm``) a Qwen3; a
Mistral is a Llama whose attention may be limited to a sliding window. Its canonical tensors are already in Hugging
Face's layout, so converting is renaming and cutting fused weights:

- ``linear_qkv`` is [q_proj; k_proj; v_proj] stacked along the output dimension, q with heads x head_dim rows, k
  and v with groups x head_dim rows each, heads in order inside each block (no per-group interleaving: tensor
  parallelism splits each block separately, so the canonical tensor is the plain stack); Qwen2's biases likewise.
- ``linear_fc1`` is [gate_proj; up_proj]; ``linear_proj`` is o_proj, ``linear_fc2`` down_proj; no transposes.
- Rotary embeddings use the rotate-half convention of HF's Llama, whose q_proj/k_proj rows are already permuted for
  it (Meta's original checkpoints are not): no permutation either way. Rope scalings (``rope_type`` ``llama3``,
  ``linear``, ``yarn``) map onto ``--use-rope-scaling``, ``--rope-scaling-type`` and their parameters.
- Canonical tensors carry no vocabulary padding, so the HF vocabulary is the tokenizer's.

What megalite would compute differently is refused by name: other rope scalings (``dynamic``, ``longrope``, ...,
and yarn's ``truncate: false``), attention or MLP biases of Llama, an activation other than SiLU, Qwen3's sliding
window shorter than the context. A ``head_dim`` other than hidden size / heads is megalite's ``--kv-channels``
(Llama, Mistral and Qwen3; Qwen2's config has no head_dim). HF's models have no hidden dropout: megalite's (training
only) is not exported and is 0 on import.

Sliding windows: HF's ``sliding_window`` W lets a query see itself and the W - 1 tokens before it, megalite's
``--window-size W-1,0`` (Megatron's spelling). Mistral's window is every layer's; Qwen2's (``use_sliding_window``) is
that of the layers its ``layer_types`` call ``sliding_attention`` (by default those from ``max_window_layers`` on),
megalite's ``--window-attn-skip-freq`` pattern. A window as long as ``max_position_embeddings`` limits nothing and
imports as none. A windowed model exports as Mistral (every layer windowed) or Qwen2 (global layers first, then
windowed ones: what ``max_window_layers`` can say); Llama has no window.

config.json is written by transformers' own config class (imported only then), so it is in the format the installed
transformers reads (``rope_parameters`` from v5, ``rope_theta`` and ``rope_scaling`` before); importing reads plain
JSON in either format, with the config class's defaults for missing keys, and needs no transformers.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional

import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.model_specs import check_options_mapped
from megalite.config import ModelConfig

SILU = ("silu", "swish")   # the same function in transformers' ACT2FN

# The options that make a megalite model a Llama, with the value each must have.
LLAMA_OPTIONS = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
                 "disable_bias_linear": True}

# The model-defining options (MODEL_DEFINING) the mapping accounts for; any other must keep its default to be exported.
_MAPPED_FIELDS = {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings",
                  "vocab_size", "layernorm_epsilon", "untie_embeddings_and_output_weights", "rotary_base",
                  "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                  "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
                  "rope_scaling_type", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                  "rope_scaling_attention_factor", "yarn_unrounded_correction_range",
                  "group_query_attention", "num_query_groups", "add_qkv_bias", "kv_channels",   # HF's head_dim
                  "qk_layernorm",   # Qwen3's q_norm and k_norm
                  "window_size", "window_attn_skip_freq",   # Mistral's sliding_window, Qwen2's layer types
                  *LLAMA_OPTIONS, "no_position_embedding"}   # no learned positions beside rope anyway

# The config class's defaults, for config.json files that leave keys out (None: derived from other keys, or unset).
_COMMON_DEFAULTS = {"hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "rope_theta": 10000.0, "rope_scaling": None, "attention_dropout": 0.0, "head_dim": None}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One member of the Llama family."""
    name: str              # "LlamaForCausalLM"
    model_type: str        # config.json's model_type
    config_class: str      # transformers' config class, which writes config.json
    qkv_bias: bool         # biases on q_proj, k_proj and v_proj (megalite's --add-qkv-bias)
    defaults: dict[str, Any]
    qk_norm: bool = False  # q_norm and k_norm over each head (megalite's --qk-layernorm)


LLAMA = Architecture("LlamaForCausalLM", "llama", "LlamaConfig", False, {
    **_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048, "attention_bias": False,
    "mlp_bias": False})
MISTRAL = Architecture("MistralForCausalLM", "mistral", "MistralConfig", False, {
    **_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
    "sliding_window": 4096})
QWEN2 = Architecture("Qwen2ForCausalLM", "qwen2", "Qwen2Config", True, {
    **_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None})
# Qwen3's head_dim is its own setting (128 by default), not hidden size / heads.
QWEN3 = Architecture("Qwen3ForCausalLM", "qwen3", "Qwen3Config", False, {
    **QWEN2.defaults, "head_dim": 128, "attention_bias": False}, qk_norm=True)
ARCHITECTURES = {a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3)}
BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}

# (megalite name inside layer i, HF names inside model.layers.i it is the stack of, in order)
_LAYER_NAMES = [("input_norm.weight", ["input_layernorm.weight"]),
                ("self_attention.linear_qkv.weight",
                 ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]),
                ("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"]),
                ("pre_mlp_norm.weight", ["post_attention_layernorm.weight"]),
                ("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
                ("mlp.linear_fc2.weight", ["mlp.down_proj.weight"])]
_QKV_BIAS = ("self_attention.linear_qkv.bias", ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                "self_attn.v_proj.bias"])
_QK_NORMS = [("self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"]),
             ("self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"])]
_TOP_NAMES = [("embedding.word.weight", ["model.embed_tokens.weight"]), ("final_norm.weight", ["model.norm.weight"])]
# Buffers some HF versions store beside the parameters (rotary inverse frequencies): not weights, ignored on import.
_HF_BUFFERS = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
# The keys of HF's llama3 rope parameters, and megalite's options they set.
_LLAMA3_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
                "high_freq_factor": "rope_scaling_high_freq_factor",
                "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}
# The keys of HF's yarn rope parameters that map one to one (None in HF meaning the default), and megalite's options.
_YARN_KEYS = {"factor": "rope_scaling_factor",
              "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "rope_scaling_attention_factor"}


def export_architecture(model: ModelConfig, name: Optional[str] = None) -> Architecture:
    """The family member a Llama-shaped model exports as: ``name`` if given, else Qwen3 with per-head q/k norms,
    Qwen2 with q/k/v biases, Mistral with a sliding window and Llama otherwise (an unwindowed Mistral is the same
    network: ask for it by name)."""
    if name is None:
        return (QWEN3 if model.qk_layernorm else QWEN2 if model.add_qkv_bias
                else MISTRAL if model.window_size is not None else LLAMA)
    if name not in ARCHITECTURES:
        raise CheckpointError(f"unknown architecture {name!r} (a Llama-shaped model exports as "
                              f"{', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def is_llama_shaped(model: ModelConfig) -> bool:
    """Whether the model uses any Llama-only option (then it can only export as a Llama, if at all)."""
    return (model.group_query_attention or model.add_qkv_bias or model.qk_layernorm
            or any(getattr(model, k) == v for k, v in LLAMA_OPTIONS.items()))


def name_map(model: ModelConfig) -> list[tuple[str, list[str]]]:
    """(canonical megalite name, the HF names it stacks along dim 0) for every tensor of a Llama with this config."""
    names = list(_TOP_NAMES)
    layer_names = _LAYER_NAMES + ([_QKV_BIAS] if model.add_qkv_bias else [])
    layer_names += _QK_NORMS if model.qk_layernorm else []
    for i in range(model.num_layers):
        names += [(f"layers.{i}.{m}", [f"model.layers.{i}.{h}" for h in hf]) for m, hf in layer_names]
    if model.untie_embeddings_and_output_weights:
        names.append(("output_layer.weight", ["lm_head.weight"]))
    return names


def check_exportable(model: ModelConfig, architecture: Architecture = LLAMA) -> None:
    """Raise CheckpointError unless the model is this family member: every Llama option set, q/k norms and q/k/v
    biases as the architecture has them, every other option mapped."""
    for name, wanted in LLAMA_OPTIONS.items():
        value = getattr(model, name)
        if value != wanted:
            raise CheckpointError(
                f"cannot export as {architecture.name}: model option {name}={value!r} (a Llama needs "
                f"{name}={wanted!r}); a GPT-2-shaped model (learned positions, LayerNorm, GeLU, biases) exports as "
                f"GPT2LMHeadModel")
    if model.qk_layernorm != architecture.qk_norm:
        other = QWEN3.name if model.qk_layernorm else f"{LLAMA.name}, {MISTRAL.name} or {QWEN2.name}"
        raise CheckpointError(f"cannot export as {architecture.name}: model option qk_layernorm={model.qk_layernorm} "
                              f"(exports as {other})")
    if model.add_qkv_bias != architecture.qkv_bias:
        other = (f"{architecture.name} has no q/k/v biases" if architecture is QWEN3 else
                 f"exports as {QWEN2.name}" if model.add_qkv_bias else f"exports as {LLAMA.name} or {MISTRAL.name}")
        raise CheckpointError(f"cannot export as {architecture.name}: model option add_qkv_bias={model.add_qkv_bias} "
                              f"({other})")
    if architecture is QWEN2 and model.head_dim * model.num_attention_heads != model.hidden_size:
        raise CheckpointError(f"cannot export as {architecture.name}: kv_channels {model.head_dim} is not hidden size / "
                              f"heads (Qwen2's config has no head_dim; export as {LLAMA.name})")
    _check_window_exportable(model, architecture)
    check_options_mapped(model, _MAPPED_FIELDS, architecture.name, "Llama")


def _check_window_exportable(model: ModelConfig, architecture: Architecture) -> None:
    """A sliding window is Mistral's in every layer, Qwen2's in the layers from max_window_layers on; Llama has none."""
    windows = model.attention_windows()
    if all(w is None for w in windows):
        return
    if architecture in (LLAMA, QWEN3):
        raise CheckpointError(f"cannot export as {architecture.name}: it has no sliding window here (window_size "
                              f"{model.window_size!r}); export as {MISTRAL.name} or {QWEN2.name}")
    windowed = [w is not None for w in windows]
    first = windowed.index(True)
    if (architecture is MISTRAL and first > 0) or not all(windowed[first:]):
        raise CheckpointError(
            f"cannot export as {architecture.name}: window_attn_skip_freq {model.window_attn_skip_freq!r} makes "
            f"layers {[i for i, w in enumerate(windowed) if not w]} global; " +
            ("Mistral windows every layer" if architecture is MISTRAL else
             "Qwen2's max_window_layers makes only the first layers global"))


def to_hf(tensors: dict[str, torch.Tensor], model: ModelConfig,
          architecture: Architecture = LLAMA) -> dict[str, torch.Tensor]:
    """Canonical megalite tensors -> HF state dict (names, fused weights cut); checks every shape."""
    check_exportable(model, architecture)
    expected = name_map(model)
    extra = sorted(set(tensors) - {m for m, _ in expected})
    if extra:
        raise CheckpointError(f"cannot export as {architecture.name}: it has no counterpart of {extra[0]}")
    shapes = _hf_shapes(model)
    result = {}
    for megalite_name, hf_names in expected:
        if megalite_name not in tensors:
            raise CheckpointError(f"cannot export as {architecture.name}: the checkpoint has no {megalite_name}")
        tensor = tensors[megalite_name]
        rows = [shapes[_suffix(h)][0] for h in hf_names]   # a fused tensor's blocks, in stacking order
        if tensor.shape[0] != sum(rows):
            raise CheckpointError(f"{megalite_name} is {list(tensor.shape)}, the config says {sum(rows)} rows")
        result.update({h: block.contiguous() for h, block in zip(hf_names, tensor.split(rows), strict=True)})
    _check_shapes(result, model, "exported")
    return result


def hf_state_dict(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF decoder's state dict by full name (a bare model's names get ``model.``), without the rotary buffers, and
    without a tied ``lm_head.weight`` (the same tensor as embed_tokens, when it is stored at all); every family but
    GPT-2 names its tensors so."""
    named = {}
    for name, tensor in tensors.items():
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        if not _HF_BUFFERS.fullmatch(name):
            named[name] = tensor
    if not model.untie_embeddings_and_output_weights:
        named.pop("lm_head.weight", None)
    return named


def check_names(named: dict[str, torch.Tensor], expected: list[tuple[str, list[str]]], architecture: str) -> None:
    """One line for the first HF tensor a name map wants and the state dict lacks, or the first it has unwanted."""
    missing = [h for _, hf_names in expected for h in hf_names if h not in named]
    if missing:
        raise CheckpointError(f"input has no {missing[0]}" + (
            " (the config says tie_word_embeddings=false)" if missing[0] == "lm_head.weight" else ""))
    unexpected = sorted(set(named) - {h for _, hf_names in expected for h in hf_names})
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} for {architecture}")


def save_config(config_class: str, architecture: str, config: dict[str, Any],
                directory: str | os.PathLike) -> None:
    """Write ``directory/config.json`` with transformers' ``config_class`` (the only use of transformers in the
    converters)."""
    try:
        import transformers
    except ImportError:
        raise CheckpointError(f"exporting as {architecture} needs the transformers package: pip install "
                              f"transformers") from None
    getattr(transformers, config_class)(**config).save_pretrained(directory)


def from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig,
            architecture: Architecture = LLAMA) -> dict[str, torch.Tensor]:
    """HF state dict (with or without the ``model.`` prefix) -> canonical megalite tensors, for the model
    :func:`model_config_from` made of its config."""
    named = hf_state_dict(tensors, model)
    expected = name_map(model)
    check_names(named, expected, architecture.name)
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
            "mlp.down_proj.weight": (h, ffn), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,), "self_attn.q_norm.weight": (model.head_dim,),
            "self_attn.k_norm.weight": (model.head_dim,)}


def _check_shapes(tensors: dict[str, torch.Tensor], model: ModelConfig, what: str) -> None:
    shapes = _hf_shapes(model)
    for name, tensor in tensors.items():
        want = shapes.get(_suffix(name))
        if want is not None and tuple(tensor.shape) != want:
            raise CheckpointError(f"{what} tensor {name} is {list(tensor.shape)}, the config says {list(want)}")


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The rotary options (base, rope scaling) of either config format, refusing other rope scalings."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})   # v5 / before v5
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind not in ("default", "llama3", "linear", "yarn"):
        raise CheckpointError(f"rope scaling {kind!r} is not supported (megalite computes plain rotary embeddings "
                              f"or the llama3, linear and yarn scalings): rope_scaling/rope_parameters must be unset "
                              f"or of rope_type 'default', 'llama3', 'linear' or 'yarn'")
    theta = rope.pop("rope_theta", None) or hf["rope_theta"]
    if float(theta) != int(theta):
        raise CheckpointError(f"rope_theta {theta} is not supported (megalite's rotary base is an integer)")
    options: dict[str, Any] = {"rotary_base": int(theta)}
    if kind != "default":
        options.update(use_rope_scaling=True, rope_scaling_type=kind)
        if rope.get("factor") is None:
            raise CheckpointError(f"rope scaling {kind!r} without factor")
    if kind == "llama3":
        missing = [key for key in _LLAMA3_KEYS if rope.get(key) is None]
        if missing:
            raise CheckpointError(f"rope scaling 'llama3' without {missing[0]}")
        options.update({option: rope.pop(key) for key, option in _LLAMA3_KEYS.items()})
    elif kind == "linear":
        options["rope_scaling_factor"] = rope.pop("factor")
    elif kind == "yarn":
        options.update(_yarn(hf, rope))
    if "rope_scaling_original_max_position_embeddings" in options:
        options["rope_scaling_original_max_position_embeddings"] = int(
            options["rope_scaling_original_max_position_embeddings"])
    unknown = sorted(key for key, value in rope.items() if value is not None and key not in _LLAMA3_KEYS)
    if unknown:
        raise CheckpointError(f"rope parameter {unknown[0]}={rope[unknown[0]]!r} is not supported (rope_type "
                              f"{kind!r})")
    return options


def _yarn(hf: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """megalite's options of HF's yarn parameters, popped from ``rope``: as transformers v5 reads them (the original
    context the config's own key, else the rope parameter's, else max_position_embeddings; beta_fast and beta_slow 32
    and 1 when unset or 0; mscale and mscale_all_dim used only together)."""
    options = {option: rope.pop(key, None) for key, option in _YARN_KEYS.items()}
    if rope.pop("truncate", True) is False:   # gpt-oss: the correction range's bounds left fractional
        options["yarn_unrounded_correction_range"] = True
    options["rope_scaling_original_max_position_embeddings"] = (
        hf.get("original_max_position_embeddings") or options["rope_scaling_original_max_position_embeddings"]
        or hf["max_position_embeddings"])
    options["beta_fast"] = options["beta_fast"] or 32.0
    options["beta_slow"] = options["beta_slow"] or 1.0
    mscale, mscale_all_dim = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
    if mscale and mscale_all_dim:   # alone, transformers ignores either
        options.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    return options


def _attention_window(hf: dict[str, Any], architecture: Architecture) -> dict[str, Any]:
    """megalite's window options of HF's sliding window (W: the query and the W - 1 tokens before it); none where the
    window is as long as the context."""
    window = hf.get("sliding_window")
    if architecture in (QWEN2, QWEN3):
        if not hf["use_sliding_window"]:
            return {}
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf["max_window_layers"] else "full_attention"
            for i in range(hf["num_hidden_layers"])]
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise CheckpointError(f"layer_types {unknown[0]!r} is not supported")
        windowed = [kind == "sliding_attention" for kind in layer_types]
    elif architecture is MISTRAL:
        windowed = [True] * hf["num_hidden_layers"]
    else:
        return {}
    if window is None or window >= hf["max_position_embeddings"] or not any(windowed):
        return {}
    if architecture is QWEN3:   # its sliding layers are untested against transformers here
        raise CheckpointError(f"use_sliding_window with sliding_window {window} is not supported: it is shorter than "
                              f"max_position_embeddings {hf['max_position_embeddings']} (Qwen3's windows are not "
                              f"converted)")
    if window < 1:
        raise CheckpointError(f"sliding_window {window} is not supported (a query sees at least itself)")
    skip = None if all(windowed) else "[" + ",".join(str(int(w)) for w in windowed) + "]"
    return {"window_size": f"{window - 1},0", "window_attn_skip_freq": skip}


def model_config_from(hf: dict[str, Any]) -> ModelConfig:
    """The megalite ModelConfig of an HF Llama, Mistral, Qwen2 or Qwen3 config.json (refusing what megalite would
    compute differently)."""
    architecture = BY_MODEL_TYPE.get(hf.get("model_type"))
    if architecture is None:
        raise CheckpointError(f"model_type {hf.get('model_type')!r}: not one of {', '.join(BY_MODEL_TYPE)}")
    hf = {**architecture.defaults, **hf}   # an explicit null stays null (Mistral's sliding_window: none)
    rope = _rope(hf)
    if hf["hidden_act"] not in SILU:
        raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (megalite's SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise CheckpointError(f"{key}={hf[key]} is not supported (megalite's {architecture.name} has no "
                                  f"biases there)")
    window_options = _attention_window(hf, architecture)
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    # head_dim other than hidden / heads (as in Qwen3-32B): megalite's --kv-channels.
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
                       position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       group_query_attention=grouped, num_query_groups=groups if grouped else 1,
                       disable_bias_linear=True, add_qkv_bias=architecture.qkv_bias, kv_channels=kv_channels,
                       qk_layernorm=architecture.qk_norm, **window_options, **rope)


def hf_config_from(model: ModelConfig, eod: int | None = None, dtype: torch.dtype = torch.float32,
                   architecture: Architecture = LLAMA) -> dict[str, Any]:
    """The keyword arguments of the config class of ``architecture`` equal to a megalite model."""
    config = {"architectures": [architecture.name], "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
              "intermediate_size": model.ffn_size, "num_hidden_layers": model.num_layers,
              "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.query_groups,
              "hidden_act": "silu", "max_position_embeddings": model.max_positions,
              "initializer_range": model.init_method_std, "rms_norm_eps": model.layernorm_epsilon,
              "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
              "rope_theta": float(model.rotary_base), "attention_dropout": model.attention_dropout,
              "bos_token_id": eod, "eos_token_id": eod, "dtype": str(dtype).removeprefix("torch.")}
    if model.use_rope_scaling:
        config["rope_scaling"] = _rope_scaling(model)
    if architecture is LLAMA:
        config.update(head_dim=model.head_dim, attention_bias=False, mlp_bias=False)
    elif architecture is QWEN3:
        config.update(head_dim=model.head_dim, attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        windows = model.attention_windows()
        window = next((w + 1 for w in windows if w is not None), None)   # HF counts the query itself
        if architecture is MISTRAL:
            config.update(head_dim=model.head_dim, sliding_window=window)
        elif window is None:
            config.update(use_sliding_window=False, sliding_window=None)
        else:
            config.update(use_sliding_window=True, sliding_window=window,
                          max_window_layers=next(i for i, w in enumerate(windows) if w is not None),
                          layer_types=["full_attention" if w is None else "sliding_attention" for w in windows])
    return config


def _rope_scaling(model: ModelConfig) -> dict[str, Any]:
    """HF's rope parameters of a model with --use-rope-scaling."""
    kind = model.rope_scaling_type
    if kind == "linear":
        return {"rope_type": "linear", "factor": model.rope_scaling_factor}
    if kind == "llama3":
        return {"rope_type": "llama3", **{key: getattr(model, option) for key, option in _LLAMA3_KEYS.items()}}
    rope = {"rope_type": "yarn", **{key: getattr(model, option) for key, option in _YARN_KEYS.items()
                                    if getattr(model, option) is not None}}
    if model.yarn_unrounded_correction_range:
        rope["truncate"] = False
    if model.mscale_all_dim:   # validation: mscale is 1 otherwise, and unused
        rope.update(mscale=model.mscale, mscale_all_dim=model.mscale_all_dim)
    return rope


def write_hf_config(model: ModelConfig, directory: str | os.PathLike, eod: int | None = None,
                    dtype: torch.dtype = torch.float32, architecture: Architecture = LLAMA) -> None:
    """Write ``directory/config.json`` with transformers' config class."""
    save_config(architecture.config_class, architecture.name, hf_config_from(model, eod, dtype, architecture),
                directory)
