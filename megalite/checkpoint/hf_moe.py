"""Megalite's mixtures of experts <-> Hugging Face ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and
``Qwen3MoeForCausalLM``: names, shapes and config.

All three are Llama-shaped attention (megalite.checkpoint.hf_llama's names and rules: rotary positions, RMSNorm, no
biases, grouped-query attention) with routed SwiGLU experts in place of the MLP:

- the router ``gate.weight`` [E, h] is ``mlp.router.weight``; expert j's gate and up projections stack into
  ``mlp.experts.j.linear_fc1.weight`` = [gate; up], its down projection is ``linear_fc2`` (Mixtral calls them w1, w3
  and w2); transformers 5 holds them fused in memory (``experts.gate_up_proj`` [E, 2f, h], ``experts.down_proj``
  [E, h, f]) but writes, and the hub holds, one tensor per expert: that is what export writes, and import reads
  either;
- routing: Mixtral takes the softmax over all experts, keeps the top k and renormalizes them, which is megalite's
  default (the softmax over the k chosen logits); Qwen's ``norm_topk_prob`` false keeps the top k of the softmax as
  they are: ``--moe-router-pre-softmax``;
- Qwen2-MoE adds a shared expert (``shared_expert.{gate,up,down}_proj``) scaled by sigmoid(``shared_expert_gate``):
  ``mlp.shared_experts`` with ``--moe-shared-expert-gate``; its dense layers (``mlp_only_layers``,
  ``decoder_sparse_step``) become ``--moe-layer-freq``'s pattern; its q/k/v projections have biases (``qkv_bias``):
  ``--add-qkv-bias`` (a Qwen2-MoE exported without them gets zero biases, which every transformers version loads);
- Qwen3-MoE normalizes each head's query and key (``q_norm``/``k_norm``: ``--qk-layernorm``) and sets its head
  dimension (``head_dim``: ``--kv-channels``).

The architecture of an export follows the model: per-head q/k norms make it a Qwen3-MoE, a shared expert a
Qwen2-MoE, otherwise a Mixtral. What the chosen architecture would compute differently is refused by name (an expert
bias, sigmoid scores, a scaled routing weight, a shared expert without its gate, sliding-window attention, ...).
Options that only shape training (balancing losses, capacity factor, dispatcher, grouped products) are not
exported; an import sets the balancing loss from ``router_aux_loss_coef``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from megalite.checkpoint import hf_llama
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.model_specs import check_options_mapped
from megalite.config import ModelConfig

MIXTRAL, QWEN2_MOE, QWEN3_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
MODEL_TYPES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE}

# The model-defining options a conversion accounts for beside the Llama ones (the router's score function and
# scaling keep their defaults: check_exportable names them).
_MAPPED_FIELDS = hf_llama._MAPPED_FIELDS | {
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_pre_softmax"}

# The HF names of a MoE block, legacy (per expert, on disk) layout: (router, expert prefix, gate, up, down).
_BLOCKS = {MIXTRAL: ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", "w1", "w3", "w2"),
           QWEN2_MOE: ("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
           QWEN3_MOE: ("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj")}


def architecture(model: ModelConfig) -> str:
    """The HF architecture a megalite mixture of experts exports as (see the module docstring)."""
    if model.qk_layernorm:
        return QWEN3_MOE
    return QWEN2_MOE if model.moe_shared_expert_intermediate_size else MIXTRAL


def check_exportable(model: ModelConfig) -> None:
    """Raise CheckpointError unless the model is exactly one of the three architectures."""
    arch = architecture(model)
    for name, wanted in hf_llama.LLAMA_OPTIONS.items():
        if getattr(model, name) != wanted:
            raise CheckpointError(f"cannot export as {arch}: model option {name}={getattr(model, name)!r} (it "
                                  f"needs {name}={wanted!r})")
    refusals = [(model.moe_router_score_function != "softmax", "moe_router_score_function"),
                (model.moe_router_topk_scaling_factor is not None, "moe_router_topk_scaling_factor"),
                (arch == MIXTRAL and model.moe_router_pre_softmax, "moe_router_pre_softmax"),
                (arch != QWEN3_MOE and model.query_size != model.hidden_size, "kv_channels"),
                (arch != QWEN2_MOE and model.add_qkv_bias, "add_qkv_bias"),
                (arch == MIXTRAL and not all(model.moe_layers()), "moe_layer_freq"),
                (arch == QWEN2_MOE and not model.moe_shared_expert_gate, "moe_shared_expert_gate"),
                (arch == QWEN3_MOE and model.moe_shared_expert_intermediate_size, "moe_shared_expert_intermediate_size")]
    for refused, name in refusals:
        if refused:
            raise CheckpointError(f"cannot export as {arch}: model option {name}={getattr(model, name)!r} has no "
                                  f"{arch} counterpart")
    check_options_mapped(model, _MAPPED_FIELDS, arch, arch.removesuffix("ForCausalLM"))


# ---- names ----------------------------------------------------------------------------------------------------------

def name_map(model: ModelConfig) -> list[tuple[str, list[str]]]:
    """(canonical megalite name, the HF names it stacks along dim 0) for every tensor of this model's architecture."""
    arch = architecture(model)
    router, experts, gate, up, down = _BLOCKS[arch]
    names = list(hf_llama._TOP_NAMES)
    for i, moe in enumerate(model.moe_layers()):
        layer = [(m, hf) for m, hf in hf_llama._LAYER_NAMES if not m.startswith("mlp.")]
        if model.add_qkv_bias:
            layer.append(hf_llama._QKV_BIAS)
        if model.qk_layernorm:
            layer += hf_llama._QK_NORMS
        if not moe:
            layer += [(m, hf) for m, hf in hf_llama._LAYER_NAMES if m.startswith("mlp.")]
        else:
            layer.append(("mlp.router.weight", [router]))
            for j in range(model.num_experts):
                layer += [(f"mlp.experts.{j}.linear_fc1.weight", [f"{experts}.{j}.{gate}.weight",
                                                                  f"{experts}.{j}.{up}.weight"]),
                          (f"mlp.experts.{j}.linear_fc2.weight", [f"{experts}.{j}.{down}.weight"])]
            if model.moe_shared_expert_intermediate_size:
                layer += [("mlp.shared_experts.linear_fc1.weight", ["mlp.shared_expert.gate_proj.weight",
                                                                    "mlp.shared_expert.up_proj.weight"]),
                          ("mlp.shared_experts.linear_fc2.weight", ["mlp.shared_expert.down_proj.weight"]),
                          ("mlp.shared_experts.gate_weight", ["mlp.shared_expert_gate.weight"])]
        names += [(f"layers.{i}.{m}", [f"model.layers.{i}.{h}" for h in hf]) for m, hf in layer]
    if model.untie_embeddings_and_output_weights:
        names.append(("output_layer.weight", ["lm_head.weight"]))
    return names


def _rows(model: ModelConfig, hf_name: str) -> int:
    """Rows of an HF tensor (the dimension fused megalite tensors stack)."""
    suffix = re.sub(r"^model\.layers\.\d+\.", "", hf_name)
    if re.search(r"(experts\.\d+\.(w2|down_proj)|shared_expert\.down_proj)\.weight$", suffix):
        return model.hidden_size
    if re.search(r"experts\.\d+\.(w1|w3|gate_proj|up_proj)\.weight$", suffix):
        return model.expert_ffn_size
    if re.search(r"shared_expert\.(gate|up)_proj\.weight$", suffix):
        return model.moe_shared_expert_intermediate_size
    if suffix.endswith(("gate.weight", "shared_expert_gate.weight")):   # the router [E, h], the shared gate [1, h]
        return 1 if suffix.endswith("shared_expert_gate.weight") else model.num_experts
    return hf_llama._hf_shapes(model)[hf_llama._suffix(hf_name)][0]   # the attention and dense MLP: a Llama's


def to_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical megalite tensors -> the HF state dict as the hub holds it (one tensor per expert)."""
    check_exportable(model)
    expected = name_map(model)
    extra = sorted(set(tensors) - {m for m, _ in expected})
    if extra:
        raise CheckpointError(f"cannot export as {architecture(model)}: it has no counterpart of {extra[0]}")
    result = {}
    for megalite_name, hf_names in expected:
        if megalite_name not in tensors:
            raise CheckpointError(f"cannot export as {architecture(model)}: the checkpoint has no {megalite_name}")
        rows = [_rows(model, h) for h in hf_names]
        tensor = tensors[megalite_name]
        if tensor.shape[0] != sum(rows):
            raise CheckpointError(f"{megalite_name} is {list(tensor.shape)}, the config says {sum(rows)} rows")
        result.update({h: block.contiguous() for h, block in zip(hf_names, tensor.split(rows), strict=True)})
    if architecture(model) == QWEN2_MOE and not model.add_qkv_bias:   # zero q/k/v biases: what the model computes
        for i in range(model.num_layers):
            kv = model.query_groups * model.head_dim
            for name, rows in zip(hf_llama._QKV_BIAS[1], (model.query_size, kv, kv)):
                result[f"model.layers.{i}.{name}"] = torch.zeros(rows, dtype=tensors["final_norm.weight"].dtype)
    return result


def _unfused(named: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory layout (experts fused, Mixtral's block named mlp) in the legacy per-expert one."""
    router, experts, gate, up, down = _BLOCKS[arch]
    result = {}
    for name, tensor in named.items():
        match = re.fullmatch(r"(model\.layers\.\d+\.)mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)",
                             name)
        if match is None or (arch != MIXTRAL and match[2] == "gate.weight"):
            result[name] = tensor
        elif match[2] == "gate.weight":
            result[match[1] + router] = tensor
        elif match[2] == "experts.down_proj":
            result.update({f"{match[1]}{experts}.{j}.{down}.weight": t for j, t in enumerate(tensor.unbind(0))})
        else:
            for j, fused in enumerate(tensor.unbind(0)):
                first, second = fused.chunk(2)
                result[f"{match[1]}{experts}.{j}.{gate}.weight"] = first
                result[f"{match[1]}{experts}.{j}.{up}.weight"] = second
    return result


def from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF state dict (per-expert or fused, with or without the ``model.`` prefix) -> canonical megalite tensors,
    for the model :func:`model_config_from` made of its config."""
    arch = architecture(model)
    named = _unfused(hf_llama.hf_state_dict(tensors, model), arch)
    expected = name_map(model)
    hf_llama.check_names(named, expected, arch)
    result = {}
    for megalite_name, hf_names in expected:
        for h in hf_names:
            rows = _rows(model, h)
            if named[h].shape[0] != rows:
                raise CheckpointError(f"input tensor {h} is {list(named[h].shape)}, the config says {rows} rows")
        result[megalite_name] = torch.cat([named[h] for h in hf_names]).contiguous()
    return result


# ---- config ---------------------------------------------------------------------------------------------------------

_HF_DEFAULTS = {**hf_llama.LLAMA.defaults, "router_aux_loss_coef": 0.001, "num_experts_per_tok": 2,
                "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "sliding_window": None,
                "use_sliding_window": False, "qkv_bias": True}


def model_config_from(hf: dict[str, Any]) -> ModelConfig:
    """The megalite ModelConfig of an HF Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    arch = MODEL_TYPES.get(hf.get("model_type"))
    if arch is None:
        raise CheckpointError(f"model_type {hf.get('model_type')!r}: not one of {', '.join(MODEL_TYPES)}")
    hf = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    rope = hf_llama._rope(hf)   # rotary base (and Llama 3's scaling)
    if hf["hidden_act"] not in hf_llama.SILU:
        raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (megalite's SwiGLU uses silu)")
    if arch == MIXTRAL and hf["sliding_window"] is not None:
        raise CheckpointError(f"sliding_window {hf['sliding_window']} is not supported (megalite's attention sees "
                              f"the whole sequence)")
    if hf["use_sliding_window"]:
        raise CheckpointError("use_sliding_window is not supported (megalite's attention sees the whole sequence)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError("attention or MLP biases are not supported (megalite's MoE models have none)")
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    if head_dim * heads != hidden and arch != QWEN3_MOE:
        raise CheckpointError(f"head_dim {head_dim} x {heads} heads is not hidden_size {hidden}")
    groups = hf["num_key_value_heads"] or heads
    layers = hf["num_hidden_layers"]
    dense = set(hf["mlp_only_layers"]) if arch != MIXTRAL else set()
    pattern = [int(i not in dense and (i + 1) % hf["decoder_sparse_step"] == 0) for i in range(layers)]
    shared = hf.get("shared_expert_intermediate_size") if arch == QWEN2_MOE else None
    expert_ffn = hf["intermediate_size"] if arch == MIXTRAL else hf["moe_intermediate_size"]
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
        kv_channels=head_dim if head_dim * heads != hidden else None, seq_length=hf["max_position_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
        init_method_std=hf["initializer_range"], hidden_dropout=0.0, attention_dropout=hf["attention_dropout"],
        layernorm_epsilon=hf["rms_norm_eps"], untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True, **rope,
        add_qkv_bias=arch == QWEN2_MOE and bool(hf["qkv_bias"]),
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else 1,
        disable_bias_linear=True, qk_layernorm=arch == QWEN3_MOE, num_experts=experts, moe_ffn_hidden_size=expert_ffn,
        moe_router_topk=hf["num_experts_per_tok"], moe_layer_freq="1" if all(pattern) else str(pattern),
        moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=bool(shared),
        moe_router_pre_softmax=arch != MIXTRAL and not hf["norm_topk_prob"],
        moe_aux_loss_coeff=float(hf["router_aux_loss_coef"]))


def hf_config_from(model: ModelConfig, eod: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The keyword arguments of the transformers config class of :func:`architecture` equal to a megalite model."""
    arch = architecture(model)
    config = hf_llama.hf_config_from(model, eod, dtype)
    config.update(architectures=[arch], num_experts_per_tok=model.moe_router_topk,
                  router_aux_loss_coef=model.moe_aux_loss_coeff)
    config.pop("mlp_bias")
    if arch == MIXTRAL:
        config.update(intermediate_size=model.expert_ffn_size, num_local_experts=model.num_experts,
                      sliding_window=None)
        return config
    config.update(num_experts=model.num_experts, moe_intermediate_size=model.expert_ffn_size,
                  norm_topk_prob=not model.moe_router_pre_softmax, decoder_sparse_step=1,
                  mlp_only_layers=[i for i, moe in enumerate(model.moe_layers()) if not moe],
                  use_sliding_window=False)
    if arch == QWEN2_MOE:
        config.pop("attention_bias")
        config.update(shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size, qkv_bias=True)
    return config


def write_hf_config(model: ModelConfig, directory: str | os.PathLike, eod: int | None = None,
                    dtype: torch.dtype = torch.float32) -> None:
    """Write ``directory/config.json`` with the transformers config class of the model's architecture."""
    arch = architecture(model)
    hf_llama.save_config(arch.replace("ForCausalLM", "Config"), arch, hf_config_from(model, eod, dtype), directory)
