"""Resharding as pure tensor maths: merge stored TP slices, re-split for another TP size; glue optimizer ranges."""

from __future__ import annotations

import pytest
import torch

from megalite.checkpoint import TensorSpec
from megalite.checkpoint.reshard import assemble, coverage_problem, merge, split
from megalite.tensor_parallel import Partition, shard


@pytest.mark.parametrize("full_shape, partition", [
    ((301, 8), Partition(dim=0, padded_size=None)),        # replaced per TP below (padding depends on TP)
    ((24, 8), Partition(dim=0, fused=3)),                  # QKV
    ((16, 8), Partition(dim=0, fused=(8, 4, 4))),          # grouped-query QKV
    ((8, 24), Partition(dim=1)),                           # row-parallel
    ((8,), Partition()),                                   # replicated
])
@pytest.mark.parametrize("saved_tp, new_tp", [(1, 4), (2, 4), (4, 2), (4, 1), (2, 2)])
def test_merge_then_split_equals_sharding_the_full_tensor(full_shape, partition, saved_tp, new_tp):
    full = torch.randn(full_shape)

    def at(tp: int) -> Partition:   # the vocabulary is padded to a multiple of 128 x TP
        if partition.padded_size is None and full_shape[0] == 301:
            return Partition(dim=0, padded_size=-(-301 // (128 * tp)) * 128 * tp)
        return partition

    saved = at(saved_tp)
    slices_count = saved_tp if saved.is_sharded else 1
    if saved.is_sharded and any(b % saved_tp for b in saved.block_sizes(saved.padded_size or full_shape[0])):
        pytest.skip("not divisible")
    slices = [shard(full, saved, r, slices_count) for r in range(slices_count)]
    merged = merge(slices, TensorSpec(full_shape, saved, slices_count, "float32"))
    assert torch.equal(merged, full)
    for rank in range(new_tp):
        assert torch.equal(split(merged, at(new_tp), rank, new_tp), shard(full, at(new_tp), rank, new_tp))


def test_coverage_and_assemble():
    assert coverage_problem([(0, 4), (4, 10)], 10) is None
    assert coverage_problem([(0, 4), (6, 10)], 10) == "elements 4-6 are missing"
    assert coverage_problem([(0, 4)], 10) == "elements 4-10 are missing"
    assert coverage_problem([(0, 6), (4, 10)], 10) == "range 4-10 overlaps another"
    pieces = {(4, 10): torch.arange(4, 10.0), (0, 4): torch.arange(0, 4.0)}
    assert torch.equal(assemble(pieces, 10), torch.arange(10.0))
    with pytest.raises(ValueError, match="missing"):
        assemble({(0, 4): torch.zeros(4)}, 10)
