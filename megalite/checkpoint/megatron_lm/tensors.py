"""Megatron's tensors <-> megalite's canonical ones, and Megatron's tensor-parallel split of each.

Both of Megatron's formats are turned into one form first, *Megatron's whole state dict*: the names of its local
layer spec (``decoder.layers.7.input_layernorm.weight``, ``decoder.layers.7.mlp.experts.local_experts.5...``) with
layers and experts numbered globally, every tensor whole (tensor-parallel shards joined), the vocabulary padded as
Megatron pads it. From there to megalite is renaming plus two changes of layout:

- ``linear_qkv``: Megatron interleaves per query group, [q heads of group 0; k_0; v_0; q heads of group 1; ...]
  (each TP rank holds whole groups); megalite stacks [q; k; v] (tensor parallelism splits each block separately).
- the vocabulary: Megatron's rows past the true vocabulary are padding, which megalite leaves out (its logits of
  padding are masked out of the softmax, Megatron's are not: an export pads with zero rows, logit 0).

fc1 of a gated MLP (SwiGLU) is [gate; up] whole in both; each Megatron TP rank holds [its gate rows; its up rows]
(:data:`GATED`), which :func:`join` and :func:`cut` account for. Transformer Engine's layer spec stores the norms
inside the next linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) and grouped experts as
``experts.linear_fc1.weight5``: :func:`local_name` reads those spellings too.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from megalite.checkpoint.errors import CheckpointError
from megalite.config import ModelConfig

# Megatron fragment -> megalite fragment, applied in order to turn a whole-state-dict name into a canonical one.
_RENAMES = (("decoder.layers.", "layers."), ("decoder.final_layernorm.", "final_norm."),
            (".input_layernorm.", ".input_norm."), (".pre_mlp_layernorm.", ".pre_mlp_norm."),
            (".experts.local_experts.", ".experts."), ("embedding.word_embeddings.", "embedding.word."),
            ("embedding.position_embeddings.", "embedding.position."))
VOCABULARY = ("embedding.word_embeddings.weight", "output_layer.weight")
QKV = re.compile(r"decoder\.layers\.\d+\.self_attention\.linear_qkv\.(weight|bias)")
# Transformer Engine's spellings (legacy files of its layer spec) -> the local spec's.
_TE_NAMES = ((".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
             (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."))
_TE_GROUPED_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)")

# How Megatron's tensor parallelism splits each tensor of a layer (by the name's ending): rows (dim 0), columns
# (dim 1), or rows of a gated fc1 (each rank: [its gate rows; its up rows]); anything else is replicated.
_ROWS = re.compile(r".*\.(self_attention\.linear_qkv\.(weight|bias)|linear_fc1\.(weight|bias))|"
                   r"(embedding\.word_embeddings|output_layer)\.weight")
_COLUMNS = re.compile(r".*\.(linear_proj|linear_fc2)\.weight")
GATED = re.compile(r".*\.linear_fc1\.(weight|bias)")
EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)")
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


def local_name(name: str) -> str:
    """A Megatron state-dict name in the local layer spec's spelling (Transformer Engine's read too)."""
    for te, local in _TE_NAMES:
        if te in name:
            name = name.replace(te, local)
    grouped = _TE_GROUPED_EXPERT.fullmatch(name)
    if grouped:
        name = f"{grouped[1]}.local_experts.{grouped[4]}.{grouped[2]}.{grouped[3]}"
    return name


def canonical_name(megatron_name: str) -> str:
    for old, new in _RENAMES:
        megatron_name = megatron_name.replace(old, new)
    return megatron_name


def split_dim(name: str, gated: bool) -> Optional[str]:
    """How Megatron's TP splits ``name``: "rows", "columns", "gated" (rows of [gate; up] halves) or None."""
    if gated and GATED.fullmatch(name):
        return "gated"
    if _ROWS.fullmatch(name):
        return "rows"
    return "columns" if _COLUMNS.fullmatch(name) else None


def join(shards: list[torch.Tensor], how: Optional[str]) -> torch.Tensor:
    """The whole tensor from its TP shards (in TP-rank order)."""
    if how is None:
        return shards[0]
    if how == "gated":
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=0 if how == "rows" else 1)


def cut(tensor: torch.Tensor, how: Optional[str], tp: int) -> list[torch.Tensor]:
    """The TP shards of a whole tensor (the inverse of :func:`join`)."""
    if how is None:
        return [tensor] * tp
    if how == "gated":
        gate, up = (h.chunk(tp) for h in tensor.chunk(2))
        return [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
    return list(tensor.chunk(tp, dim=0 if how == "rows" else 1))


def _qkv_blocks(model: ModelConfig) -> tuple[int, int, int]:
    """(query groups, query heads per group, head dim)."""
    groups = model.query_groups
    return groups, model.num_attention_heads // groups, model.head_dim


def ungroup_qkv(tensor: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Megatron's per-group [q_g; k_g; v_g] blocks -> megalite's [q; k; v]."""
    groups, per_group, head_dim = _qkv_blocks(model)
    blocks = tensor.reshape(groups, per_group + 2, head_dim, *tensor.shape[1:])
    q, k, v = blocks[:, :per_group], blocks[:, per_group], blocks[:, per_group + 1]
    return torch.cat([q.reshape(-1, *tensor.shape[1:]), k.reshape(-1, *tensor.shape[1:]),
                      v.reshape(-1, *tensor.shape[1:])])


def group_qkv(tensor: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """megalite's [q; k; v] -> Megatron's per-group blocks."""
    groups, per_group, head_dim = _qkv_blocks(model)
    rest = tensor.shape[1:]
    q, k, v = tensor.split([groups * per_group * head_dim, groups * head_dim, groups * head_dim])
    blocks = torch.cat([q.reshape(groups, per_group, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                        v.reshape(groups, 1, head_dim, *rest)], dim=1)
    return blocks.reshape(-1, *rest)


def to_canonical(whole: dict[str, torch.Tensor], model: ModelConfig,
                 expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Megatron's whole state dict -> megalite's canonical tensors for ``model``, whose names and (unpadded) shapes
    are ``expected``; a tensor missing, left over or of another shape is an error naming it."""
    tied = not model.untie_embeddings_and_output_weights
    result = {}
    for name, tensor in whole.items():
        if tied and name == "output_layer.weight":
            continue   # the last stage's copy of the tied embedding
        if QKV.fullmatch(name):
            tensor = ungroup_qkv(tensor, model)
        if name in VOCABULARY:
            if tensor.shape[0] < model.vocab_size:
                raise CheckpointError(f"{name} has {tensor.shape[0]} rows, fewer than the vocabulary "
                                      f"({model.vocab_size})")
            tensor = tensor[:model.vocab_size]
        result[canonical_name(name)] = tensor
    missing = sorted(set(expected) - set(result))
    if missing:
        raise CheckpointError(f"the Megatron checkpoint has no counterpart of megalite's {missing[0]}")
    extra = sorted(set(result) - set(expected))
    if extra:
        raise CheckpointError(f"the Megatron checkpoint's {_megatron_name(extra[0], whole)} has no counterpart in "
                              f"megalite's model")
    for name, shape in expected.items():
        if result[name].shape != shape:
            raise CheckpointError(f"{name}: the Megatron checkpoint's tensor is {list(result[name].shape)}, the model "
                                  f"options say {list(shape)}")
    return result


def _megatron_name(canonical: str, whole: dict[str, torch.Tensor]) -> str:
    return next(name for name in whole if canonical_name(name) == canonical)


def megatron_name(canonical: str) -> str:
    """The inverse of :func:`canonical_name`."""
    name = canonical
    for old, new in reversed(_RENAMES):
        if old.startswith("."):
            name = name.replace(new, old)
        elif name.startswith(new):
            name = old + name[len(new):]
    return name


def from_canonical(canonical: dict[str, torch.Tensor], model: ModelConfig,
                   padded_vocab: int) -> dict[str, torch.Tensor]:
    """megalite's canonical tensors -> Megatron's whole state dict (vocabulary padded with zero rows, the tied
    output layer a copy of the embedding as Megatron's last stage holds it)."""
    result = {}
    for name, tensor in canonical.items():
        name = megatron_name(name)
        if QKV.fullmatch(name):
            tensor = group_qkv(tensor, model)
        if name in VOCABULARY:
            tensor = torch.cat([tensor, tensor.new_zeros(padded_vocab - tensor.shape[0], *tensor.shape[1:])])
        result[name] = tensor.contiguous()
    if not model.untie_embeddings_and_output_weights:
        result["output_layer.weight"] = result["embedding.word_embeddings.weight"]
    return result
