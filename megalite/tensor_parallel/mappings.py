"""Autograd-aware communication for the tensor-parallel region (Shoeybi et al. 2019, Megatron-LM).

Each op is a pair of conjugate collectives: what the forward does, the backward undoes for the gradient.

| op                          | forward                  | backward                 |
|-----------------------------|--------------------------|--------------------------|
| copy_to_tensor_parallel     | identity                 | all-reduce               |
| reduce_from_tensor_parallel | all-reduce               | identity                 |
| scatter_to_tensor_parallel  | keep my slice (last dim) | all-gather (last dim)    |
| gather_from_tensor_parallel | all-gather (last dim)    | keep my slice (last dim) |

(the last two along any ``dim``: the MoE layer uses them along the sequence.)

A column-parallel linear starts with ``copy`` and a row-parallel one ends with ``reduce``: one all-reduce forward
and one backward per pair, two pairs per transformer layer.

Sequence parallelism (Korthikanti et al. 2022) keeps the activations between those pairs (norms, dropout, residual)
split along the sequence (dim 1 of [batch, seq, hidden]) and turns each all-reduce into its two halves:

| op                                  | forward                  | backward                 |
|-------------------------------------|--------------------------|--------------------------|
| (column-parallel linear's input)    | all-gather (seq)         | reduce-scatter (seq)     |
| reduce_scatter_to_sequence_parallel | reduce-scatter (seq)     | all-gather (seq)         |

The first is fused into the linear (megalite.tensor_parallel.layers). ``all_gather_tensor_parallel(x, dim)`` is the
same pair along any dim, for a gather whose consumers differ per rank (so their gradients must be summed over TP
before each rank keeps its slice): grouped-query attention uses it on the last dim when there are fewer key/value
heads than TP ranks. ``all_gather_over(x, dim, group)`` is that pair over another group.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.parallel_state import GroupInfo


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    info = parallel_state.get_tensor_model_parallel_group()
    if info.size == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=info.group)
    return x


SEQUENCE_DIM = 1   # activations are [batch, sequence, hidden]

# torch 2.13 renamed the flat-tensor collective (the old name warns); older torch has only the old one.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def split(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication)."""
    info = parallel_state.get_tensor_model_parallel_group()
    if info.size == 1:
        return x
    size = x.shape[dim]
    if size % info.size:
        raise ValueError(f"dimension {dim} of size {size} cannot be split over {info.size} tensor-parallel ranks")
    return x.chunk(info.size, dim=dim)[info.rank].contiguous()


def all_gather(x: torch.Tensor, dim: int, info: GroupInfo | None = None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (over ``info``, by default the TP group)."""
    info = info or parallel_state.get_tensor_model_parallel_group()
    if info.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(info.size)]
    dist.all_gather(parts, x, group=info.group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, dim: int, info: GroupInfo | None = None) -> torch.Tensor:
    """The sum of every rank's ``x``, keeping this rank's slice along ``dim`` (over ``info``, default the TP group)."""
    info = info or parallel_state.get_tensor_model_parallel_group()
    if info.size == 1:
        return x
    if x.shape[dim] % info.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} cannot be split over {info.size} ranks")
    front = x.movedim(dim, 0).contiguous()   # the collective splits the leading dimension
    out = front.new_empty((front.shape[0] // info.size, *front.shape[1:]))
    _reduce_scatter_flat(out, front, group=info.group)
    return out.movedim(0, dim).contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # Compiled (--torch-compile), out of place: dynamo does not trace mark_dirty, and the compiler plans the
        # buffers itself.
        if not x.is_contiguous() or torch.compiler.is_compiling():
            return _all_reduce(x)
        # The partial sums are a fresh activation (a matmul's or the embedding's output) that nothing else keeps:
        # sum them in place rather than into a copy. mark_dirty makes autograd refuse, at backward, any graph that
        # did save this tensor, so a caller breaking that assumption gets an error, not a wrong gradient.
        dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group().group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Along(torch.autograd.Function):
    """``forward(x, dim)``, whose gradient is ``backward(grad, dim)``: the scatter, gather and reduce-scatter rows of
    the tables above."""

    @staticmethod
    def forward(ctx, x, dim, forward, backward):
        ctx.dim, ctx.conjugate = dim, backward
        return forward(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.conjugate(grad, ctx.dim), None, None, None


def conjugate(x: torch.Tensor, argument, forward, backward) -> torch.Tensor:
    """``forward(x, argument)`` whose gradient is ``backward(grad, argument)``, for conjugate pairs over other groups
    (the MoE dispatcher's all-gather / reduce-scatter over the expert-parallel group)."""
    return _Along.apply(x, argument, forward, backward)


def _tensor_parallel() -> bool:
    """Whether there is a TP group to talk to; at TP=1 every op below is the identity, and skipping its autograd
    Function saves a Python-level node per call in forward and backward (several per layer)."""
    return parallel_state.get_tensor_model_parallel_world_size() > 1


def copy_to_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x) if _tensor_parallel() else x


def reduce_from_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x) if _tensor_parallel() else x


def scatter_to_tensor_parallel(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _Along.apply(x, dim, split, all_gather) if _tensor_parallel() else x


def gather_from_tensor_parallel(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` (the last by default); backward keeps this rank's slice, for consumers that compute
    the same thing on every rank (the MoE layer gathers the sequence this way)."""
    return _Along.apply(x, dim, all_gather, split) if _tensor_parallel() else x


def all_gather_tensor_parallel(x: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather along ``dim``; backward reduce-scatters (each rank may consume a different part of the result)."""
    return _Along.apply(x, dim, all_gather, reduce_scatter) if _tensor_parallel() else x


def reduce_scatter_to_sequence_parallel(x: torch.Tensor) -> torch.Tensor:
    return _Along.apply(x, SEQUENCE_DIM, reduce_scatter, all_gather) if _tensor_parallel() else x


def all_gather_over(x: torch.Tensor, dim: int, info: GroupInfo) -> torch.Tensor:
    """:func:`all_gather_tensor_parallel` over another group (context parallelism gathers keys and values over CP)."""
    if info.size == 1:
        return x
    return _Along.apply(x, dim, functools.partial(all_gather, info=info), functools.partial(reduce_scatter, info=info))
