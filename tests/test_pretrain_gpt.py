"""The entry point as users run it: flags + Hydra overrides, the metrics-file contract, fail-fast errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pretrain_gpt

ROOT = Path(__file__).resolve().parent.parent
METRIC_KEYS = {"iteration", "loss", "grad_norm", "lr", "consumed_samples", "elapsed_ms", "tokens_per_sec"}


def _torchrun(nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           str(ROOT / "pretrain_gpt.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_single_process_run_writes_the_metrics_contract(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    code = pretrain_gpt.main(["model=gpt_tiny", "--train-iters", "4", "--log-interval", "2", "--eval-interval", "2",
                              "--eval-iters", "1", "--metrics-file", str(metrics), "optimizer.lr=1e-3"])
    assert code == 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in lines if "loss" in r]
    evaluations = [r for r in lines if "eval_loss" in r]
    assert [r["iteration"] for r in records] == [2, 4]
    assert [r["iteration"] for r in evaluations] == [2, 4] and evaluations[1]["eval_loss"] > 0
    assert all(METRIC_KEYS <= r.keys() for r in records)
    assert records[-1]["consumed_samples"] == 4 * 8
    assert "iteration      2/4" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--num-attention-heads", "3", "--hidden-size", "64"], "hidden-size 64 is not divisible by num-attention-heads 3"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by tensor-model-parallel-size 2"),
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
    good = _torchrun(2, "--tensor-model-parallel-size", "2", "model=gpt_tiny", "--train-iters", "6", "--eval-iters",
                     "1", "--lr", "2e-3", "--metrics-file", str(metrics))
    assert good.returncode == 0, good.stderr[-2000:]
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]

    bad = _torchrun(2, "--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "96",
                    timeout=60)
    assert bad.returncode != 0
    lines = [l for l in bad.stderr.splitlines() if "megalite: error:" in l]
    assert len(lines) == 2   # one per rank
    assert all("num-attention-heads 3 is not divisible by tensor-model-parallel-size 2" in l for l in lines)
