"""An MoE run reports, per MoE layer, its balancing losses and its load in the metrics file, on TensorBoard and on the
console; the expert biases move by the update rule from the global batch's loads."""

from __future__ import annotations

import pytest

import pretrain_gpt

from ..helpers import read_metrics

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_metrics_file_and_tensorboard_hold_each_moe_layers_losses_and_load(tmp_path, capsys):
    argv = ["model=gpt_tiny", "data=mock", "--num-layers", "3", "--train-iters", "2", "--eval-interval", "0",
            "--micro-batch-size", "4", "--global-batch-size", "4",
            "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[1,0,1]",
            "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.0",
            "--tensorboard-dir", str(tmp_path / "tb"), "--metrics-file", str(tmp_path / "m.jsonl")]
    assert pretrain_gpt.main(argv) == 0
    record = read_metrics(tmp_path / "m.jsonl")[-1]
    assert record["moe_layers"] == [0, 2]
    tokens = 4 * 32 * 2   # global batch x sequence x top-2
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_mean", "moe_dropped"):
        assert len(record[key]) == 2, key
    for mean, dropped, most in zip(record["moe_load_mean"], record["moe_dropped"], record["moe_load_max"]):
        assert mean * 4 + dropped == tokens and mean <= most <= tokens / 4 * 1.0 * 1.0 + 1e-9   # capacity binds
    assert all(0.01 <= a < 0.02 for a in record["moe_aux_loss"])   # ~ coeff for near-uniform routing
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"moe_aux_loss/layer_0", "moe_aux_loss/layer_2", "moe_load_max/layer_2", "moe_dropped/layer_0"} <= tags
    assert "moe aux loss" in capsys.readouterr().out
