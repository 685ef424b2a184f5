"""Resharding, as pure tensor functions: stored pieces -> canonical full tensor -> this rank's piece.

A parameter was stored as ``slices`` tensor-parallel slices (:func:`megalite.tensor_parallel.shard` of the full
tensor); merging them with ``unshard`` gives the canonical, unpadded tensor, from which ``shard`` cuts the slice of
any other TP size. Optimizer states are stored per flat range of a slice (a distributed-optimizer rank owns a range
of the flat buffer, not whole parameters): :func:`assemble` glues the ranges back into the slice, checking they
tile it exactly. Going through the full tensor costs memory for one parameter at a time, and makes every change of
TP, PP, virtual stages, DP or optimizer sharding the same simple path.
"""

from __future__ import annotations

from typing import Optional

import torch

from megalite.checkpoint.manifest import TensorSpec
from megalite.tensor_parallel import Partition, shard, unshard


def merge(slices: list[torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    """The canonical full tensor (vocabulary padding removed) from its stored slices, each in its slice shape."""
    partition = spec.partition
    full_size = spec.full_shape[partition.dim] if partition.is_sharded else None
    return unshard(slices, partition, full_size)


def split(full: torch.Tensor, partition: Partition, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a canonical full tensor (padded as the partition says)."""
    return shard(full, partition, rank, world).contiguous()


def coverage_problem(ranges: list[tuple[int, int]], numel: int) -> Optional[str]:
    """None if the sorted ranges tile [0, numel) exactly, else what is wrong, e.g. 'elements 96-128 are missing'."""
    position = 0
    for lo, hi in sorted(ranges):
        if lo > position:
            return f"elements {position}-{lo} are missing"
        if lo < position or hi <= lo:
            return f"range {lo}-{hi} overlaps another"
        position = hi
    if position != numel:
        return f"elements {position}-{numel} are missing" if position < numel else f"ranges run past {numel}"
    return None


def assemble(pieces: dict[tuple[int, int], torch.Tensor], numel: int) -> torch.Tensor:
    """A flat tensor of ``numel`` elements from pieces keyed by their [lo, hi) range (which must tile it)."""
    problem = coverage_problem(list(pieces), numel)
    if problem is not None:
        raise ValueError(problem)
    return torch.cat([pieces[r].reshape(-1) for r in sorted(pieces)]) if pieces else torch.empty(0)
