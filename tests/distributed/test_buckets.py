"""Gradient-buffer plan: every parameter placed once, buckets padded for equal DP shards, deferred ones last."""

from __future__ import annotations

import torch

from megalite.distributed.buckets import ALIGNMENT, plan_buckets


def _params(*sizes):
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def test_reverse_order_contiguous_and_padded():
    params = _params(10, 20, 30, 40)
    plan = plan_buckets(params, bucket_size=45, dp=4)
    # Reverse order: the last parameter (40 elements) comes first.
    assert plan.ranges[id(params[3])] == (0, 40)
    assert [len(b.params) for b in plan.buckets] == [2, 2]     # 40+30 closes the first bucket, then 20+10
    for b in plan.buckets:
        assert (b.end - b.start) % (4 * ALIGNMENT) == 0
        s0, e0 = b.shard(0, 4)
        s3, e3 = b.shard(3, 4)
        assert s0 == b.start and e3 == b.end and e0 - s0 == e3 - s3
    assert plan.buckets[1].start == plan.buckets[0].end
    covered = sorted(plan.ranges.values())
    assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:]))   # no overlap


def test_deferred_parameters_get_their_own_last_bucket():
    params = _params(8, 8, 8)
    plan = plan_buckets(params, bucket_size=10**6, dp=2, deferred=[params[0]])
    assert len(plan.buckets) == 2
    assert plan.buckets[-1].deferred and plan.buckets[-1].params == [params[0]]
    assert not plan.buckets[0].deferred


def test_separate_parameters_get_buckets_of_their_own_between_the_others_and_the_deferred():
    """--fp8-param-gather's FP8 weights: never in a bucket with other parameters, in reverse order, before deferred."""
    params = _params(8, 16, 8, 16, 8)
    fp8 = [params[1], params[3]]
    plan = plan_buckets(params, bucket_size=10**6, dp=2, deferred=[params[0]], separate=fp8)
    assert [b.params for b in plan.buckets] == [[params[4], params[2]], [params[3], params[1]], [params[0]]]
    assert [b.deferred for b in plan.buckets] == [False, False, True]


def test_parameters_together_lie_next_to_each_other_in_their_order_in_one_bucket():
    """An MoE layer's experts' weights of a kind (interleaved with their biases in definition order): laid out
    consecutively, first expert first, where the first of them would go, and never cut by a bucket's end."""
    params = _params(4, 10, 1, 10, 1, 10, 1)   # a norm, then (weight, bias) of three experts
    weights, biases = params[1::2], params[2::2]
    plan = plan_buckets(params, bucket_size=15, dp=2, together=[weights, biases])
    assert [plan.ranges[id(p)] for p in biases] == [(0, 1), (1, 2), (2, 3)]
    assert [plan.ranges[id(p)] for p in weights] == [(3, 13), (13, 23), (23, 33)]
    assert [b.params for b in plan.buckets] == [biases + weights, [params[0]]]
    # A group not wholly among the parameters is left alone.
    assert plan_buckets(params[:3], 10**6, 2, together=[weights]).ranges == plan_buckets(params[:3], 10**6, 2).ranges
