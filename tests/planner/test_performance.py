"""Muon's cost in the planner (megalite.planner.performance.muon_step_cost) against numbers computed by hand for a
2-layer model of hidden size 64 (q, k, v and the output projection 64 x 64, the MLP's 256 x 64 and 64 x 256)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megalite.optimizer.muon import newton_schulz
from megalite.planner.hardware import Hardware
from megalite.planner.layout import Layout
from megalite.planner.performance import TF32_PEAK_RATIO, muon_step_cost, newton_schulz_flops, step_time

from ..helpers import tiny_config

MODEL = tiny_config().model   # 2 layers, hidden 64, 4 heads, ffn 256


def test_newton_schulz_flops_are_those_of_the_implementation():
    """The formula against torch's count of the products megalite's Newton-Schulz runs, on both orientations."""
    for shape in [(64, 256), (256, 64)]:
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(*shape), 5)
        assert counter.get_total_flops() == newton_schulz_flops(64, 256, 5) == 5 * 2 * (2 * 64 * 64 * 256 + 64 ** 3)


# Per layer, by hand (5 steps; a g x n matrix costs 10 (2 g^2 n + g^3)): q, k, v and the projection 64 x 64:
# 7,864,320 each; fc1 and fc2, Gram side 64, other 256: 23,592,960 each; the layer 78,643,200.
LAYER = 4 * 7_864_320 + 2 * 23_592_960


@pytest.mark.parametrize("layout, flops, tp_bytes, dp_bytes", [
    (Layout(), 2 * LAYER, 0, 0),
    # Every TP rank runs the whole matrices and gathers them: 192 x 64 + 64 x 64 + 2 x 256 x 64 floats a layer.
    (Layout(tp=2), 2 * LAYER, 2 * 49152 * 4, 0),
    # Gram side 64 whole, the long side halved: q, k, v (32 x 64) and the projection (64 x 32) 5,242,880 each,
    # fc1 (128 x 64) and fc2 (64 x 128) 13,107,200 each; six 64 x 64 Gram sums a step (and the norm) per layer.
    (Layout(tp=2, muon_tp_mode="distributed"), 2 * (4 * 5_242_880 + 2 * 13_107_200), 2 * 6 * (5 * 64 * 64 * 4 + 4), 0),
    # The shards alone: q, k, v 32 x 64 (Gram 32), projection 64 x 32, fc1 128 x 64, fc2 64 x 128.
    (Layout(tp=2, muon_tp_mode="blockwise"),
     2 * (3 * newton_schulz_flops(32, 64, 5) + newton_schulz_flops(32, 64, 5) + 2 * newton_schulz_flops(64, 128, 5)),
     0, 0),
    # Layer-wise over DP=2 (by size: rank 0 both fc1s, a qkv and a projection): a layer's worth each. ZeRO-1: the
    # bucket of all but the tied embedding (102,144 floats) gathered and scattered; ZeRO-3: each rank sends half of
    # the other's matrices (24,576 floats) and receives half of its own, in each of two all-to-alls.
    (Layout(dp=2, zero=1), LAYER, 0, 2 * 4 * 102_144),
    (Layout(dp=2, zero=3), LAYER, 0, 2 * 4 * 24_576),
    (Layout(dp=2, zero=0), 2 * LAYER, 0, 0),   # plain DP: every rank all of them
])
def test_muon_cost_is_the_hand_computed(layout, flops, tp_bytes, dp_bytes):
    layout = dataclasses.replace(layout, muon=True)
    cost = muon_step_cost(MODEL, layout, Hardware())
    assert (cost.flops, cost.tp_bytes, cost.dp_bytes) == (flops, tp_bytes, dp_bytes)


def test_muon_seconds_join_the_step():
    hardware = Hardware()
    adam, muon = (step_time(MODEL, Layout(dp=2, zero=3, muon=m), hardware, 8) for m in (False, True))
    cost = muon_step_cost(MODEL, Layout(dp=2, zero=3, muon=True), hardware)
    compute = LAYER / (hardware.peak_flops * TF32_PEAK_RATIO * hardware.efficiency)
    assert cost.seconds == pytest.approx(compute + 2 * 4 * 24_576 / hardware.intra_bandwidth)
    assert muon.muon == cost.seconds and muon.step == pytest.approx(adam.step + cost.seconds)
