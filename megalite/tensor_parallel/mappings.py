"""Autograd-aware communication for the tensor-parallel region (Shoeybi et al. 2019, Megatron-LM).

Each op is a pair of conjugate collectives: what the forward does, the backward undoes for the gradient.

| op                          | forward                  | backward                 |
|-----------------------------|--------------------------|--------------------------|
| copy_to_tensor_parallel     | identity                 | all-reduce               |
| reduce_from_tensor_parallel | all-reduce               | identity                 |
| scatter_to_tensor_parallel  | keep my slice (last dim) | all-gather (last dim)    |
| gather_from_tensor_parallel | all-gather (last dim)    | keep my slice (last dim) |

A column-parallel linear starts with ``copy`` and a row-parallel one ends with ``reduce``: one all-reduce forward
and one backward per pair, two pairs per transformer layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import parallel_state


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    info = parallel_state.get_tensor_model_parallel_group()
    if info.size == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=info.group)
    return x


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    info = parallel_state.get_tensor_model_parallel_group()
    if info.size == 1:
        return x
    return x.chunk(info.size, dim=-1)[info.rank].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    info = parallel_state.get_tensor_model_parallel_group()
    if info.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(info.size)]
    dist.all_gather(parts, x, group=info.group)
    return torch.cat(parts, dim=-1)


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
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


def copy_to_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x)


def reduce_from_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x)


def scatter_to_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    return _ScatterToTensorParallel.apply(x)


def gather_from_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    return _GatherFromTensorParallel.apply(x)
