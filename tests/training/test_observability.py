"""What a run shows: the TensorBoard event file holds the scalars the metrics file has (read back with
TensorBoard's own reader), including throughput, MFU, peak memory, loss scale and per-phase timers."""

from __future__ import annotations

import pytest

import pretrain_gpt

from ..data.helpers import write_progressions
from ..helpers import read_metrics

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_tensorboard_and_metrics_file_hold_the_scalars(tmp_path, capsys):
    argv = ["model=gpt_tiny", "data=mock", "--train-iters", "4", "--log-interval", "2", "--eval-interval", "4",
            "--eval-iters", "1", "--fp16", "--initial-loss-scale", "1024", "--timing-log-level", "2",
            "--peak-tflops", "1.0", "--tensorboard-dir", str(tmp_path / "tb"),
            "--metrics-file", str(tmp_path / "m.jsonl")]
    assert pretrain_gpt.main(argv) == 0
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "tflops_per_device", "mfu",
                "peak_memory_gib", "eval_loss", "time_forward_backward_ms_max", "time_forward_backward_ms_min",
                "time_grads_reduce_ms_max", "time_optimizer_ms_max", "time_pipeline_wait_ms_max"}
    assert expected <= tags, expected - tags
    assert [e.step for e in events.Scalars("loss")] == [2, 4]
    record = read_metrics(tmp_path / "m.jsonl")[0]
    assert record["mfu"] == pytest.approx(record["tflops_per_device"] / 1.0)
    assert record["time_forward_backward_ms_min"] <= record["time_forward_backward_ms_max"]
    assert "tflops per device" in capsys.readouterr().out


def test_packed_documents_report_the_tokens_the_loss_counts(tmp_path, capsys):
    """With --eod-mask-loss the metrics file says over how many tokens the loss averaged: fewer than the batch's."""
    write_progressions(tmp_path / "docs", 200, 301)
    argv = ["model=gpt_tiny", "--data-path", str(tmp_path / "docs"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "301", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--eval-interval", "0", "--reset-position-ids", "--reset-attention-mask",
            "--eod-mask-loss", "--metrics-file", str(tmp_path / "m.jsonl")]
    assert pretrain_gpt.main(argv) == 0
    records = read_metrics(tmp_path / "m.jsonl")
    assert all(0 < r["loss_tokens"] < 4 * 64 for r in records)   # every sample holds a few document ends
    assert f"loss tokens {records[-1]['loss_tokens']} |" in capsys.readouterr().out   # the console line too
