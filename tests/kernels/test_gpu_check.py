"""tools/gpu_check.py: without a GPU it stops at once with a clear message (exit code 2); its CPU dry run (the same
steps through the kernels' torch ops, tiny shapes, a tiny model) passes every check, FP8's included, and ends with
the table."""

from __future__ import annotations

import pytest
import torch

from ..helpers import launch

SCRIPT = "tools/gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run tools/gpu_check.py itself")
def test_without_a_gpu_it_exits_with_a_message():
    result = launch([SCRIPT], timeout=120)
    assert result.returncode == 2, result.stderr
    assert "gpu_check: no CUDA device is visible" in result.stderr
    assert "run it on a machine with an NVIDIA GPU" in result.stderr
    assert result.stdout == ""


def test_cpu_dry_run_passes_and_prints_the_table_last():
    result = launch([SCRIPT, "--cpu-dry-run", "--iters", "2", "--train-iters", "2"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("gpu_check summary"):]
    for op in ("masked softmax", "bias + GeLU", "bias + tanh GeLU", "LayerNorm", "RMSNorm", "rotary", "cross entropy"):
        for dtype in ("fp32", "bf16", "fp16"):
            assert any(line.startswith(f" {op} ") and f"| {dtype} " in line and "PASS" in line
                       for line in table.splitlines()), (op, dtype)
    assert "attention core" in table and "torch ops (off)" in table and "fused kernels (auto)" in table
    for recipe in ("tensorwise", "delayed", "rowwise"):   # FP8: checks of each recipe and format, speeds, training
        for fmt in ("e4m3", "hybrid"):
            assert any(line.startswith(f" FP8 linear {recipe} (") and f"| {fmt} " in line and "PASS" in line
                       for line in table.splitlines()), (recipe, fmt)
        assert any(line.startswith(f" {recipe} ") and "torch._scaled_mm" in line for line in table.splitlines())
    assert "FP8 hybrid delayed, fused kernels" in table and "FP8 hybrid tensorwise, fused kernels" in table
    assert result.stdout.rstrip().splitlines()[-1].startswith("PASS: 28/28 kernel checks passed")
