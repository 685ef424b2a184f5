"""Replicated modules (norms, learned position embeddings) marked for layout-independent initialization."""

from __future__ import annotations

from torch import nn

from megalite.tensor_parallel.partition import REPLICATED, mark, normal_init, ones_init, zeros_init


def layer_norm(hidden_size: int, eps: float) -> nn.LayerNorm:
    """A LayerNorm every TP rank holds whole; its gradients agree across TP because its inputs do."""
    norm = nn.LayerNorm(hidden_size, eps=eps)
    mark(norm.weight, norm.weight.shape, REPLICATED, ones_init)
    mark(norm.bias, norm.bias.shape, REPLICATED, zeros_init)
    return norm


def position_embedding(max_positions: int, hidden_size: int, init_std: float) -> nn.Embedding:
    table = nn.Embedding(max_positions, hidden_size)
    mark(table.weight, table.weight.shape, REPLICATED, normal_init(init_std))
    return table
