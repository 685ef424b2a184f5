"""The global gradient norm over every shard of the model, and clipping by it.

Each rank sums the squares of the gradients it owns: tensor-parallel shards on every TP rank, replicated parameters
(norms, row-parallel biases, position embeddings) on TP rank 0 only, and the last stage's copy of a tied embedding
not at all, so nothing is counted twice. One all-reduce
over the model-parallel group (TP x PP) gives the squared norm of one whole replica; DP replicas hold equal
gradients after the data-parallel reduction, so they need no further sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import parallel_state


def _is_owned_here(param: torch.nn.Parameter) -> bool:
    if getattr(param, "is_embedding_copy", False):
        return False
    sharded = getattr(param, "partition", None) is not None and param.partition.is_sharded
    return sharded or parallel_state.get_tensor_model_parallel_rank() == 0


def global_grad_norm(params: list[torch.nn.Parameter]) -> float:
    grads = [p.grad for p in params if p.grad is not None and _is_owned_here(p)]
    device = params[0].device if params else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        squares += grad.float().pow(2).sum()
    info = parallel_state.get_model_parallel_group()
    if info.size > 1:
        dist.all_reduce(squares, group=info.group)
    return float(squares.sqrt())


@torch.no_grad()
def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Scale all gradients so their global norm is at most ``max_norm`` (0 disables); return the norm before."""
    norm = global_grad_norm(params)
    if max_norm > 0 and norm > max_norm:
        coefficient = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)
    return norm
