"""Gradient reductions that must finish before the optimizer step.

- Over data-parallel replicas: one flat all-reduce per dtype after the last micro-batch. The loss each rank
  backpropagates is already divided by the number of tokens in the *global* batch, so the sum over DP ranks (not the
  mean) is the gradient of the global-batch mean loss. The bucketed, overlapped engine is the [optimizer] issue's;
  this is its plain reference.
- Over the embedding group: with pipelining, the word embedding (first stage) and the output layer tied to it (last
  stage) are two copies of one weight; summing their gradients keeps them equal, as if they were one tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import parallel_state


@torch.no_grad()
def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    info = parallel_state.get_data_parallel_group()
    if info.size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=info.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def all_reduce_tied_embedding_gradients(tied_weights: list[torch.nn.Parameter]) -> None:
    """Sum the gradient of this rank's copy of the tied word embedding with the other stage's copy."""
    info = parallel_state.get_embedding_group()
    if info is None or info.size == 1:
        return
    for weight in tied_weights:
        dist.all_reduce(weight.grad, group=info.group)
