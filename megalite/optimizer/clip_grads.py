"""The global gradient norm over every shard of the model, and clipping by it.

Each rank sums the squares of the gradient pieces it owns: tensor-parallel shards on every TP rank, replicated
parameters (norms, row-parallel biases, position embeddings; under sequence parallelism too, since the data-parallel
engine has summed their gradients over TP by then) on TP rank 0 only, and the last stage's copy of a tied
embedding not at all. With the distributed optimizer a rank holds only its DP x CP shard of each gradient, so the
pieces of different DP x CP ranks are disjoint and the sum also runs over DP x CP (with HSDP over one instance of
it, whose pieces tile the model: the other instances hold the same); without it, those replicas hold equal gradients
and are not summed. One all-reduce per group gives the squared norm of exactly one whole model.
"""

from __future__ import annotations

import torch

from megalite import parallel_state


def counts_toward_norm(param: torch.nn.Parameter) -> bool:
    """Whether this rank's copy of ``param`` is the one whose gradient enters the global norm."""
    if getattr(param, "is_embedding_copy", False):
        return False
    partition = getattr(param, "partition", None)
    sharded = partition is not None and partition.is_sharded
    return sharded or parallel_state.get_tensor_model_parallel_rank() == 0


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    # One fused pass over every gradient (no squared copy of each): the per-piece norms, then their squares summed.
    return (torch.stack(torch._foreach_norm(grads, 2)).float().pow(2).sum().to(device) if grads
            else torch.zeros((), dtype=torch.float32, device=device))


def global_grad_norm(pieces: list[tuple[torch.nn.Parameter, torch.Tensor]], sharded_over_data: bool) -> float:
    """L2 norm of the whole model's gradient from this rank's (parameter, gradient piece) pairs.

    Routed experts' parameters (``is_expert``) differ between expert-parallel ranks: unsharded, their squares are
    summed over EP (their EDP replicas are equal); sharded, their pieces are disjoint over EP x EDP = DP x CP."""
    # Summed where the groups' collectives run (NCCL: the GPU), whether the pieces are there, on the CPU
    # (--offload-params) or absent (a rank that owns none).
    device = parallel_state.collective_device()
    counted = [(param, grad) for param, grad in pieces if counts_toward_norm(param)]
    squares = _sum_of_squares([g for p, g in counted if not getattr(p, "is_expert", False)], device)
    expert_squares = _sum_of_squares([g for p, g in counted if getattr(p, "is_expert", False)], device)
    if sharded_over_data:
        squares += expert_squares
        parallel_state.get_intra_distributed_optimizer_instance_group().sum(squares)   # DP x CP unless HSDP
    else:
        parallel_state.get_expert_model_parallel_group().sum(expert_squares)
        squares += expert_squares
    parallel_state.get_model_parallel_group().sum(squares)
    return float(squares.sqrt())


@torch.no_grad()
def clip_by_global_norm_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place so the global norm ``norm`` becomes at most ``max_norm`` (0 disables)."""
    if max_norm > 0 and norm > max_norm:
        coefficient = max_norm / (norm + 1e-6)
        torch._foreach_mul_(grads, coefficient)
