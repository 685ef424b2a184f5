"""Tensor-parallel layers: Megatron's column/row-parallel linears and the vocab-parallel embedding.

A column-parallel linear keeps a block of output rows of the weight (Y_i = X A_i); a row-parallel linear keeps a block
of input columns (Y = sum_i X_i B_i, summed by an all-reduce). An MLP or attention block is column-parallel then
row-parallel, so the activation between them never leaves its rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state
from megalite.tensor_parallel.mappings import (copy_to_tensor_parallel, gather_from_tensor_parallel,
                                               reduce_from_tensor_parallel, scatter_to_tensor_parallel)
from megalite.tensor_parallel.partition import REPLICATED, Partition, local_shape, mark, normal_init, zeros_init


def _parameter(full_shape: tuple[int, ...], partition: Partition, init_fn) -> nn.Parameter:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    param = nn.Parameter(torch.empty(local_shape(full_shape, partition, tp)))
    return mark(param, full_shape, partition, init_fn)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows split over TP. ``fused`` > 1 splits each of that many stacked blocks
    separately (a fused QKV weight [q; k; v] gives each rank its heads' q, k and v). ``padded_output_size`` zero-pads
    the rows first (the vocabulary of an output layer). With ``weight_from_caller`` the layer owns no weight and
    ``forward`` takes one (an output layer tied to the word embedding)."""

    def __init__(self, input_size: int, output_size: int, *, init_std: float, bias: bool = True,
                 gather_output: bool = False, fused: int = 1, padded_output_size: int | None = None,
                 weight_from_caller: bool = False):
        super().__init__()
        if gather_output and fused > 1:
            raise ValueError("a gathered output of a fused weight would interleave the blocks rank by rank")
        self.gather_output = gather_output
        partition = Partition(dim=0, fused=fused, padded_size=padded_output_size)
        self.weight = (None if weight_from_caller
                       else _parameter((output_size, input_size), partition, normal_init(init_std)))
        self.bias = _parameter((output_size,), partition, zeros_init) if bias else None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        y = F.linear(copy_to_tensor_parallel(x), weight, self.bias)
        return gather_from_tensor_parallel(y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x B^T + b with B's input columns split over TP; partial products are summed by one all-reduce.
    The bias is replicated and added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, *, init_std: float, bias: bool = True,
                 input_is_parallel: bool = True):
        super().__init__()
        self.input_is_parallel = input_is_parallel
        self.weight = _parameter((output_size, input_size), Partition(dim=1), normal_init(init_std))
        self.bias = _parameter((output_size,), REPLICATED, zeros_init) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows. Each rank looks up the ids in its range, writes zeros for the others,
    and an all-reduce assembles the full embeddings. Rows past ``num_embeddings`` (vocabulary padding) start at zero
    and, never looked up, stay there."""

    def __init__(self, num_embeddings: int, padded_num_embeddings: int, embedding_dim: int, *, init_std: float):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        partition = Partition(dim=0, padded_size=padded_num_embeddings)
        self.weight = _parameter((num_embeddings, embedding_dim), partition, normal_init(init_std))
        per_rank = padded_num_embeddings // tp
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(embeddings)
