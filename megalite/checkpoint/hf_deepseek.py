"""Megalite's multi-latent-attention mixtures of experts <-> Hugging Face ``DeepseekV3ForCausalLM``: names, shapes
and config.

- Attention (megalite.model.latent_attention, Megatron's names): ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or
  ``q_proj`` without ``q_lora_rank``) are ``linear_q_down_proj``/``q_layernorm``/``linear_q_up_proj`` (or
  ``linear_q_proj``); ``kv_a_proj_with_mqa``/``kv_a_layernorm``/``kv_b_proj`` are ``linear_kv_down_proj``/
  ``kv_layernorm``/``linear_kv_up_proj``; ``o_proj`` is ``linear_proj``. Per-head rows are in the same order.
- Rotary channels: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... (``rope_interleave``,
  true by default), whose rotated output transformers lays out as [evens, odds]; megalite rotates halves (x_i with
  x_i+d/2). The rope rows of the query and of the shared rotary key are therefore reordered evens-then-odds on import
  (and back on export), after which both compute the same rotated q and k, channel for channel. With
  ``rope_interleave`` false nothing is reordered.
- MoE (megalite.model.moe): the router ``gate.weight`` is ``mlp.router.weight``, its ``e_score_correction_bias`` the
  expert bias (``--moe-router-enable-expert-bias``, sigmoid scores); ``n_group``/``topk_group`` are
  ``--moe-router-num-groups``/``--moe-router-group-topk`` (transformers sums each group's top 2: k / topk_group must
  be 2), ``routed_scaling_factor`` is ``--moe-router-topk-scaling-factor``, ``first_k_dense_replace`` the dense
  layers of ``--moe-layer-freq``, the ``n_shared_experts`` shared experts one shared expert of that many times
  ``moe_intermediate_size``. Experts are written one tensor per expert, as the hub holds them (import reads
  transformers 5's fused layout too).
- Multi-token prediction (``--mtp-num-layers``, megalite.model.multi_token_prediction): DeepSeek's checkpoints store
  module k of ``num_nextn_predict_layers`` as the layer past the model's ``num_hidden_layers`` + k (the hub's
  ``model.layers.61.*``): ``enorm``, ``hnorm``, ``eh_proj`` (the same [embedding; hidden] columns) and
  ``shared_head.norm`` (its ``final_norm``) beside a decoder layer's tensors (its ``transformer_layer``, dense or MoE as
  the model's last layer), and copies of the embedding (``embed_tokens``) and of the output layer
  (``shared_head.head``), written on export and, where stored, checked equal to the model's on import.
  transformers' DeepseekV3 has no such module: it saves none of these tensors yet keeps ``num_nextn_predict_layers``
  (1 by default), so a directory storing no layer past ``num_hidden_layers`` imports without MTP; one storing another
  number of them is refused.
- The latent norms: transformers builds them with eps 1e-6 whatever ``rms_norm_eps`` says, megalite with the
  layers' epsilon: another ``rms_norm_eps`` is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import torch

from megalite.checkpoint import hf_llama, hf_moe
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.model_specs import check_options_mapped
from megalite.config import ModelConfig

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
LATENT_NORM_EPS = 1e-6   # transformers' DeepseekV3RMSNorm default, which its q_a/kv_a norms use

_MAPPED_FIELDS = (hf_llama._MAPPED_FIELDS - {"group_query_attention", "num_query_groups", "add_qkv_bias",
                                             "kv_channels", "qk_layernorm", "window_size", "window_attn_skip_freq"}) | {
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "mtp_num_layers"}


def check_exportable(model: ModelConfig) -> None:
    """Raise CheckpointError unless the model is a DeepSeek-V3."""
    for name, wanted in {**hf_llama.LLAMA_OPTIONS, "multi_latent_attention": True,
                         "moe_router_score_function": "sigmoid", "moe_shared_expert_gate": False,
                         "moe_router_pre_softmax": False}.items():
        if getattr(model, name) != wanted:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: model option {name}={getattr(model, name)!r} "
                                  f"(it needs {name}={wanted!r})")
    if model.num_experts is None or not model.moe_shared_expert_intermediate_size:
        raise CheckpointError(f"cannot export as {ARCHITECTURE}: it needs routed experts (--num-experts) and a "
                              f"shared expert (--moe-shared-expert-intermediate-size)")
    layers = model.moe_layers()
    dense = layers.index(True) if True in layers else len(layers)
    refusals = [(any(not moe for moe in layers[dense:]), "moe_layer_freq", "dense layers first, then MoE only"),
                (model.moe_shared_expert_intermediate_size % model.expert_ffn_size != 0,
                 "moe_shared_expert_intermediate_size", "a multiple of the experts' hidden size"),
                (model.moe_router_topk < 2, "moe_router_topk", "at least 2 (transformers normalizes the top k)"),
                (model.moe_router_num_groups is not None and model.moe_router_topk // model.moe_router_group_topk != 2,
                 "moe_router_group_topk", "moe_router_topk / 2 (transformers scores a group by its top 2)"),
                (model.layernorm_epsilon != LATENT_NORM_EPS, "layernorm_epsilon",
                 f"{LATENT_NORM_EPS} (transformers' latent norms)")]
    for refused, name, wanted in refusals:
        if refused:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: model option {name}={getattr(model, name)!r} "
                                  f"(it needs {wanted})")
    check_options_mapped(model, _MAPPED_FIELDS, ARCHITECTURE, "DeepSeek-V3")


# ---- names ----------------------------------------------------------------------------------------------------------

def _layer_names(model: ModelConfig, moe: bool) -> list[tuple[str, list[str]]]:
    """A decoder layer's (megalite name, the HF names it stacks) under the layer's prefix."""
    attention = ([("linear_q_proj.weight", ["q_proj.weight"])] if model.q_lora_rank is None else
                 [("linear_q_down_proj.weight", ["q_a_proj.weight"]), ("q_layernorm.weight", ["q_a_layernorm.weight"]),
                  ("linear_q_up_proj.weight", ["q_b_proj.weight"])])
    attention += [("linear_kv_down_proj.weight", ["kv_a_proj_with_mqa.weight"]),
                  ("kv_layernorm.weight", ["kv_a_layernorm.weight"]),
                  ("linear_kv_up_proj.weight", ["kv_b_proj.weight"]), ("linear_proj.weight", ["o_proj.weight"])]
    layer = [("input_norm.weight", ["input_layernorm.weight"]),
             ("pre_mlp_norm.weight", ["post_attention_layernorm.weight"])]
    layer += [(f"self_attention.{m}", [f"self_attn.{h}" for h in hf]) for m, hf in attention]
    if not moe:
        return layer + [(m, hf) for m, hf in hf_llama._LAYER_NAMES if m.startswith("mlp.")]
    layer += [("mlp.router.weight", ["mlp.gate.weight"]),
              ("mlp.router.expert_bias", ["mlp.gate.e_score_correction_bias"])]
    for j in range(model.num_experts):
        layer += [(f"mlp.experts.{j}.linear_fc1.weight", [f"mlp.experts.{j}.gate_proj.weight",
                                                          f"mlp.experts.{j}.up_proj.weight"]),
                  (f"mlp.experts.{j}.linear_fc2.weight", [f"mlp.experts.{j}.down_proj.weight"])]
    return layer + [("mlp.shared_experts.linear_fc1.weight", ["mlp.shared_experts.gate_proj.weight",
                                                              "mlp.shared_experts.up_proj.weight"]),
                    ("mlp.shared_experts.linear_fc2.weight", ["mlp.shared_experts.down_proj.weight"])]


_MTP_NAMES = [("enorm.weight", ["enorm.weight"]), ("hnorm.weight", ["hnorm.weight"]),
              ("eh_proj.weight", ["eh_proj.weight"]), ("final_norm.weight", ["shared_head.norm.weight"])]


def name_map(model: ModelConfig) -> list[tuple[str, list[str]]]:
    """(canonical megalite name, the HF names it stacks along dim 0) for every tensor, experts one per file (the
    copies in the multi-token prediction layers: :func:`_mtp_copies`)."""
    names = list(hf_llama._TOP_NAMES)
    layers = model.moe_layers()
    for i, moe in enumerate(layers):
        names += [(f"layers.{i}.{m}", [f"model.layers.{i}.{h}" for h in hf]) for m, hf in _layer_names(model, moe)]
    for k in range(model.mtp_num_layers or 0):
        module = _MTP_NAMES + [(f"transformer_layer.{m}", hf) for m, hf in _layer_names(model, layers[-1])]
        names += [(f"mtp.layers.{k}.{m}", [f"model.layers.{model.num_layers + k}.{h}" for h in hf])
                  for m, hf in module]
    if model.untie_embeddings_and_output_weights:
        names.append(("output_layer.weight", ["lm_head.weight"]))
    return names


def _mtp_copies(model: ModelConfig) -> list[tuple[str, str]]:
    """(the model's canonical tensor, the HF name of its copy in a multi-token prediction layer)."""
    output = "output_layer.weight" if model.untie_embeddings_and_output_weights else "embedding.word.weight"
    return [(canonical, f"model.layers.{model.num_layers + k}.{copy}") for k in range(model.mtp_num_layers or 0)
            for canonical, copy in (("embedding.word.weight", "embed_tokens.weight"),
                                    (output, "shared_head.head.weight"))]


def stored_model(model: ModelConfig, tensors: dict[str, torch.Tensor]) -> ModelConfig:
    """``model`` (:func:`model_config_from`'s) as the HF state dict stores it: without multi-token prediction when no
    layer past num_hidden_layers is stored (transformers saves none yet keeps num_nextn_predict_layers); another
    number of stored modules than the config's is refused."""
    stored = sorted({int(m[1]) - model.num_layers for name in tensors
                     if (m := re.match(r"(?:model\.)?layers\.(\d+)\.", name)) and int(m[1]) >= model.num_layers})
    if not stored:
        return dataclasses.replace(model, mtp_num_layers=None)
    if stored != list(range(model.mtp_num_layers or 0)):
        raise CheckpointError(f"the weights store layers {', '.join(str(model.num_layers + k) for k in stored)} past "
                              f"num_hidden_layers {model.num_layers} (multi-token prediction modules), but "
                              f"num_nextn_predict_layers is {model.mtp_num_layers or 0}")
    return model


def _rope_order(model: ModelConfig, hf_name: str, rows: int) -> torch.Tensor | None:
    """The row order taking an HF tensor's interleaved rotary rows to megalite's halves (None: no rope rows)."""
    rope = model.qk_pos_emb_head_dim
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])   # evens, then odds
    if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        width = model.qk_head_dim + rope   # per head: nope rows, then rope rows
        heads = torch.arange(rows).view(-1, width)
        return torch.cat([heads[:, :model.qk_head_dim], heads[:, model.qk_head_dim:][:, pairs]], dim=1).flatten()
    if hf_name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        return torch.cat([torch.arange(model.kv_lora_rank), model.kv_lora_rank + pairs])
    return None


def _reorder_rope(tensors: dict[str, torch.Tensor], model: ModelConfig, to_megalite: bool) -> dict[str, torch.Tensor]:
    result = {}
    for name, tensor in tensors.items():
        order = _rope_order(model, name, tensor.shape[0])
        if order is not None:
            tensor = tensor[order] if to_megalite else tensor[torch.argsort(order)]
        result[name] = tensor
    return result


def to_hf(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical megalite tensors -> the HF state dict (one tensor per expert, rope rows interleaved)."""
    check_exportable(model)
    expected = name_map(model)
    tensors = dict(tensors)
    if not model.moe_router_enable_expert_bias:   # transformers always adds the bias: zero is what megalite computes
        for i, moe in enumerate(model.moe_layers()):
            if moe:
                tensors[f"layers.{i}.mlp.router.expert_bias"] = torch.zeros(model.num_experts)
    extra = sorted(set(tensors) - {m for m, _ in expected})
    if extra:
        raise CheckpointError(f"cannot export as {ARCHITECTURE}: it has no counterpart of {extra[0]}")
    result = {}
    for megalite_name, hf_names in expected:
        if megalite_name not in tensors:
            raise CheckpointError(f"cannot export as {ARCHITECTURE}: the checkpoint has no {megalite_name}")
        result.update(zip(hf_names, tensors[megalite_name].chunk(len(hf_names)), strict=True))
    # Separate storage: safetensors refuses to write tensors sharing memory.
    result.update({copy: tensors[canonical].clone() for canonical, copy in _mtp_copies(model)})
    return {name: t.contiguous() for name, t in _reorder_rope(result, model, to_megalite=False).items()}


def from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig, interleaved: bool = True) -> dict[str, torch.Tensor]:
    """An HF state dict (per-expert or fused) -> canonical megalite tensors, for :func:`stored_model`'s model;
    ``interleaved``: the config's rope_interleave."""
    named = hf_llama.hf_state_dict(tensors, model)
    named = hf_moe._unfused(named, hf_moe.QWEN2_MOE)   # transformers 5's fused experts: the per-expert names
    for canonical, copy in _mtp_copies(model):   # megalite's multi-token prediction shares them: copies where stored
        source = "lm_head.weight" if canonical == "output_layer.weight" else "model.embed_tokens.weight"
        if copy in named and source in named and not torch.equal(named.pop(copy), named[source]):
            raise CheckpointError(f"{copy} differs from {source} (megalite's multi-token prediction uses the model's "
                                  f"own)")
    expected = name_map(model)
    hf_llama.check_names(named, expected, ARCHITECTURE)
    if interleaved:
        named = _reorder_rope(named, model, to_megalite=True)
    return {m: torch.cat([named[h] for h in hf_names]).contiguous() for m, hf_names in expected}


# ---- config ---------------------------------------------------------------------------------------------------------

_HF_DEFAULTS = {**hf_llama._COMMON_DEFAULTS, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
                "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                "norm_topk_prob": True, "max_position_embeddings": 4096, "attention_bias": False,
                "rope_interleave": True, "num_nextn_predict_layers": 0}
_NULLABLE = ("q_lora_rank",)   # None means something (no query down-projection): kept when given as null


def model_config_from(hf: dict[str, Any]) -> ModelConfig:
    """The megalite ModelConfig of an HF DeepSeek-V3 config.json (refusing what megalite would compute otherwise)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"model_type {hf.get('model_type')!r}: not {MODEL_TYPE}")
    hf = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k in _NULLABLE}}
    rope = hf_llama._rope(hf)
    if hf["hidden_act"] not in hf_llama.SILU:
        raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (megalite's SwiGLU uses silu)")
    if hf["attention_bias"]:
        raise CheckpointError("attention_bias is not supported (megalite's multi-latent attention has no biases "
                              "on import)")
    if not hf["norm_topk_prob"] or hf["num_experts_per_tok"] < 2:
        raise CheckpointError(f"norm_topk_prob {hf['norm_topk_prob']} with num_experts_per_tok "
                              f"{hf['num_experts_per_tok']} is not supported (megalite normalizes 2 or more sigmoid "
                              f"scores)")
    groups = hf["n_group"] if hf["n_group"] > 1 else None
    if groups is not None and hf["num_experts_per_tok"] // hf["topk_group"] != 2:
        raise CheckpointError(f"num_experts_per_tok {hf['num_experts_per_tok']} / topk_group {hf['topk_group']} is "
                              f"not 2 (transformers scores a group by its top 2 experts, megalite by its top "
                              f"num_experts_per_tok / topk_group)")
    if float(hf["rms_norm_eps"]) != LATENT_NORM_EPS:
        raise CheckpointError(f"rms_norm_eps {hf['rms_norm_eps']} is not supported (transformers' latent norms use "
                              f"{LATENT_NORM_EPS}, megalite's every norm the same epsilon)")
    layers, dense = hf["num_hidden_layers"], hf["first_k_dense_replace"]
    pattern = [int(i >= dense) for i in range(layers)]
    return ModelConfig(
        num_layers=layers, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"], seq_length=hf["max_position_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
        init_method_std=hf["initializer_range"], hidden_dropout=0.0, attention_dropout=hf["attention_dropout"],
        layernorm_epsilon=float(hf["rms_norm_eps"]), untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True, **rope,
        multi_latent_attention=True, q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        num_experts=hf["n_routed_experts"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_topk=hf["num_experts_per_tok"], moe_layer_freq="1" if all(pattern) else str(pattern),
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf["n_shared_experts"],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf["routed_scaling_factor"]),
        moe_router_num_groups=groups, moe_router_group_topk=hf["topk_group"] if groups else None,
        mtp_num_layers=hf["num_nextn_predict_layers"] or None)


def hf_config_from(model: ModelConfig, eod: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The keyword arguments of transformers' DeepseekV3Config equal to a megalite model."""
    config = hf_llama.hf_config_from(model, eod, dtype)
    for key in ("num_key_value_heads", "head_dim", "attention_bias", "mlp_bias"):
        config.pop(key, None)
    layers = model.moe_layers()
    config.update(
        architectures=[ARCHITECTURE], num_key_value_heads=model.num_attention_heads, attention_bias=False,
        q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_nope_head_dim=model.qk_head_dim,
        qk_rope_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim, rope_interleave=True,
        n_routed_experts=model.num_experts, moe_intermediate_size=model.expert_ffn_size,
        n_shared_experts=model.moe_shared_expert_intermediate_size // model.expert_ffn_size,
        num_experts_per_tok=model.moe_router_topk, norm_topk_prob=True,
        routed_scaling_factor=model.moe_router_topk_scaling_factor or 1.0,
        n_group=model.moe_router_num_groups or 1, topk_group=model.moe_router_group_topk or 1,
        first_k_dense_replace=layers.index(True) if True in layers else len(layers),
        num_nextn_predict_layers=model.mtp_num_layers or 0)
    return config


def write_hf_config(model: ModelConfig, directory: str | os.PathLike, eod: int | None = None,
                    dtype: torch.dtype = torch.float32) -> None:
    """Write ``directory/config.json`` with transformers' DeepseekV3Config."""
    hf_llama.save_config("DeepseekV3Config", ARCHITECTURE, hf_config_from(model, eod, dtype), directory)
