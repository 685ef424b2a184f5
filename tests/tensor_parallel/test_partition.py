"""Sharding descriptions: shard/unshard round trips, and the per-parameter seeds behind layout-independent init."""

from __future__ import annotations

import pytest
import torch

from megalite.tensor_parallel.partition import (REPLICATED, Partition, local_shape, parameter_seed, shard,
                                                unshard)


@pytest.mark.parametrize("partition, full_shape", [
    (Partition(dim=0), (8, 3)),
    (Partition(dim=1), (3, 8)),
    (Partition(dim=0, fused=3), (12, 5)),
    (Partition(dim=0, fused=(8, 4, 4)), (16, 3)),   # grouped-query [q; k; v]: unequal blocks
    (Partition(dim=0, padded_size=16), (11, 4)),
    (REPLICATED, (4, 4)),
])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_then_unshard_is_identity(partition, full_shape, world):
    full = torch.randn(full_shape)
    parts = [shard(full, partition, rank, world) for rank in range(world)]
    assert all(p.shape == local_shape(full_shape, partition, world) for p in parts)
    size = full_shape[partition.dim] if partition.is_sharded else None
    assert torch.equal(unshard(parts, partition, size), full)


def test_fused_blocks_are_split_separately():
    q, k, v = torch.zeros(4, 1), torch.ones(4, 1), 2 * torch.ones(4, 1)
    local = shard(torch.cat([q, k, v]), Partition(dim=0, fused=3), rank=1, world=2)
    assert local.flatten().tolist() == [0, 0, 1, 1, 2, 2]


def test_unequal_fused_blocks_give_each_rank_its_slice_of_every_block():
    # GQA with 4 query heads and 2 key/value heads of dimension 1: [q0 q1 q2 q3; k0 k1; v0 v1].
    q, k, v = torch.arange(4.0), 10 + torch.arange(2.0), 20 + torch.arange(2.0)
    partition = Partition(dim=0, fused=(4, 2, 2))
    full = torch.cat([q, k, v])
    assert shard(full, partition, rank=1, world=2).tolist() == [2, 3, 11, 21]
    assert local_shape((8,), partition, 2) == (4,)
    assert torch.equal(unshard([shard(full, partition, r, 2) for r in range(2)], partition), full)


def test_equal_blocks_given_as_int_or_tuple_shard_alike():
    full = torch.randn(12, 2)
    for rank in range(2):
        assert torch.equal(shard(full, Partition(dim=0, fused=3), rank, 2),
                           shard(full, Partition(dim=0, fused=(4, 4, 4)), rank, 2))


def test_fused_blocks_that_do_not_fit_are_errors():
    with pytest.raises(ValueError, match="do not add up"):
        local_shape((10, 4), Partition(dim=0, fused=(4, 4, 4)), 1)
    with pytest.raises(ValueError, match="cannot be split"):
        local_shape((8, 4), Partition(dim=0, fused=(4, 2, 2)), 4)   # a block of 2 over 4 ranks


def test_padding_rows_are_zero():
    local = shard(torch.ones(5, 2), Partition(dim=0, padded_size=8), rank=1, world=2)
    assert local.tolist() == [[1, 1], [0, 0], [0, 0], [0, 0]]


def test_seeds_differ_by_name_and_run_seed():
    assert parameter_seed(1, "layers.0.mlp.linear_fc1.weight") != parameter_seed(1, "layers.1.mlp.linear_fc1.weight")
    assert parameter_seed(1, "a") != parameter_seed(2, "a")
    assert parameter_seed(1, "a") == parameter_seed(1, "a")


def test_indivisible_split_is_an_error():
    with pytest.raises(ValueError, match="cannot be split"):
        local_shape((10, 4), Partition(dim=0), 4)
