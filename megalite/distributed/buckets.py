"""Where each parameter's gradient lives: one flat buffer, cut into buckets for reduction (a pure plan).

Parameters are laid out in reverse order of definition, which is roughly the order backward produces their
gradients, so the first bucket fills first and its reduction can start while backward works on the rest. A bucket
closes once it holds ``bucket_size`` elements, and is padded to a multiple of the data-parallel size so that each
rank owns an equal contiguous shard of it (reduce-scatter, the distributed optimizer). Parameters flagged
``deferred`` (a tied embedding whose gradient must first be summed across pipeline stages) go in a bucket of their
own that is reduced only after that sum. Parameters given as ``separate`` (the FP8 linears' weights under
``--fp8-param-gather``, whose buckets are all-gathered as FP8 bytes) go in buckets of their own too, after the
ordinary ones. Parameters given ``together`` (an MoE layer's experts' weights of one kind, which the grouped product
reads as one stacked tensor) lie next to each other in the given order, in one bucket, where the first of them
would have gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ALIGNMENT = 16   # elements; keeps shards and buckets aligned for vectorized copies


@dataclass
class Bucket:
    index: int
    start: int                       # [start, end) in the flat buffer, padded
    end: int
    params: list[torch.nn.Parameter] = field(default_factory=list)
    deferred: bool = False

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        """This rank's contiguous shard of the bucket, in flat-buffer coordinates."""
        size = (self.end - self.start) // world
        return self.start + rank * size, self.start + (rank + 1) * size


@dataclass
class BucketPlan:
    buckets: list[Bucket]
    ranges: dict[int, tuple[int, int]]     # id(param) -> [start, end) in the flat buffer
    bucket_of: dict[int, int]              # id(param) -> bucket index
    total: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _units(params: list[torch.nn.Parameter], together: list[list[torch.nn.Parameter]]):
    """``params`` in order, one at a time, but a group of ``together`` whole where its first member comes (groups
    not wholly among ``params`` are ignored)."""
    present = {id(p) for p in params}
    group_of = {id(p): group for group in together if all(id(q) in present for q in group) for p in group}
    placed: set[int] = set()
    for p in params:
        if id(p) in placed:
            continue
        unit = group_of.get(id(p), [p])
        placed.update(id(q) for q in unit)
        yield unit


def plan_buckets(params: list[torch.nn.Parameter], bucket_size: int, dp: int,
                 deferred: list[torch.nn.Parameter] = (),
                 separate: list[torch.nn.Parameter] = (),
                 together: list[list[torch.nn.Parameter]] = ()) -> BucketPlan:
    """Lay ``params`` out (given in definition order) into buckets; see the module docstring."""
    deferred_ids, separate_ids = {id(p) for p in deferred}, {id(p) for p in separate} - {id(p) for p in deferred}
    ordinary = [p for p in reversed(params) if id(p) not in deferred_ids | separate_ids]
    apart = [p for p in reversed(params) if id(p) in separate_ids]
    late = [p for p in reversed(params) if id(p) in deferred_ids]
    buckets: list[Bucket] = []
    ranges: dict[int, tuple[int, int]] = {}
    bucket_of: dict[int, int] = {}
    offset = 0

    def close(bucket: Bucket) -> None:
        nonlocal offset
        bucket.end = bucket.start + _round_up(max(offset - bucket.start, 1), dp * ALIGNMENT)
        offset = bucket.end
        buckets.append(bucket)

    for group, is_deferred in ((ordinary, False), (apart, False), (late, True)):
        bucket = None
        for unit in _units(group, together):
            if bucket is None:
                bucket = Bucket(len(buckets), offset, offset, deferred=is_deferred)
            for p in unit:
                ranges[id(p)] = (offset, offset + p.numel())
                bucket_of[id(p)] = bucket.index
                bucket.params.append(p)
                offset += p.numel()
            if offset - bucket.start >= bucket_size:
                close(bucket)
                bucket = None
        if bucket is not None:
            close(bucket)
    return BucketPlan(buckets, ranges, bucket_of, offset)
