"""The entry point as users run it: flags + Hydra overrides, the metrics-file contract, fail-fast errors."""

from __future__ import annotations

import json
import math

import pytest

import pretrain_gpt

from .helpers import launch, losses, read_metrics

METRIC_KEYS = {"iteration", "loss", "grad_norm", "lr", "consumed_samples", "elapsed_ms", "tokens_per_sec"}


def test_single_process_run_writes_the_metrics_contract(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    code = pretrain_gpt.main(["model=gpt_tiny", "--train-iters", "4", "--log-interval", "2", "--eval-interval", "2",
                              "--eval-iters", "1", "--metrics-file", str(metrics), "optimizer.lr=1e-3"])
    assert code == 0
    lines = read_metrics(metrics)
    records = [r for r in lines if "loss" in r]
    evaluations = [r for r in lines if "eval_loss" in r]
    assert [r["iteration"] for r in records] == [2, 4]
    assert [r["iteration"] for r in evaluations] == [2, 4] and evaluations[1]["eval_loss"] > 0
    assert all(METRIC_KEYS <= r.keys() for r in records)
    assert records[-1]["consumed_samples"] == 4 * 8
    assert "iteration      2/4" in capsys.readouterr().out


def test_deepspeed_config_stage_1_bf16_trains_and_prints_its_settings(tmp_path, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):   # one process: data-parallel size 1
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    metrics = tmp_path / "metrics.jsonl"
    code = pretrain_gpt.main(["model=gpt_tiny", "data=mock", "--deepspeed-config", str(config), "--train-iters", "2",
                              "--eval-interval", "0", "--metrics-file", str(metrics), "--lr", "2e-3"])
    assert code == 0
    out = capsys.readouterr().out
    assert f"deepspeed config {config}: 7 keys: 7 mapped, 0 ignored, 0 refused" in out
    table = [" ".join(line.split()) for line in out.splitlines() if line.startswith("  ")]
    for line in ["zero_optimization.stage 1 mapped --use-distributed-optimizer --zero-stage 1",
                 "bf16.enabled true mapped --bf16", "train_batch_size 4 mapped --global-batch-size 4",
                 "optimizer.params.lr 0.001 mapped --lr 0.001; the command line's --lr 0.002 wins"]:
        assert line in table, out
    assert "bfloat16" in out and "2 micro-batches per step" in out   # 4 = 2 x GA 2 x DP 1
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == [1, 2] and records[-1]["consumed_samples"] == 8
    assert all(math.isfinite(r["loss"]) for r in records)


def test_deepspeed_config_refusal_fails_with_one_line_after_its_table(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                                                        "sub_group_size": 1e9}}))
    assert pretrain_gpt.main(["--deepspeed-config", str(config)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("megalite: error: --deepspeed-config") and "\n" not in err
    assert "zero_optimization.offload_param.device=nvme" in err and "sub_group_size" not in err
    assert "3 keys: 1 mapped, 1 ignored, 1 refused" in captured.out   # the table says what else the file holds
    assert "zero_optimization.offload_param.device  nvme" in captured.out


@pytest.mark.parametrize("argv, message", [
    (["--num-attention-heads", "3", "--hidden-size", "64"], "--hidden-size 64 is not divisible by --num-attention-heads 3"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--no-such-flag", "1"], "unknown flag --no-such-flag"),
    (["--num-layers", "two"], "argument --num-layers: invalid int value: 'two'"),
    (["model.num_layer=2"], "bad override"),
])
def test_bad_options_fail_with_one_line(argv, message, capsys):
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("megalite: error:") and "\n" not in err


def test_torchrun_tensor_parallel_run_and_bad_layout_on_every_rank(tmp_path):
    metrics = tmp_path / "m.jsonl"
    good = launch(["pretrain_gpt.py", "--tensor-model-parallel-size", "2", "model=gpt_tiny", "--train-iters", "6",
                   "--eval-iters", "1", "--lr", "2e-3", "--metrics-file", str(metrics)], nproc=2, timeout=120)
    assert good.returncode == 0, good.stderr[-2000:]
    good_losses = losses(read_metrics(metrics))
    assert len(good_losses) == 6 and good_losses[-1] < good_losses[0]

    bad = launch(["pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
                  "--hidden-size", "96"], nproc=2, timeout=60)
    assert bad.returncode != 0
    lines = [l for l in bad.stderr.splitlines() if "megalite: error:" in l]
    assert len(lines) == 2   # one per rank
    assert all("--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2" in l for l in lines)
