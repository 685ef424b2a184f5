"""Where the per-step times go: beside the metrics file (the recording itself is tested on 4 ranks in
tests/multiprocess/test_step_times.py)."""

from __future__ import annotations

from pathlib import Path

from megalite.training.step_times import StepTimeRecorder, steps_file


def test_the_steps_file_sits_beside_the_metrics_file():
    assert steps_file("run/metrics.jsonl") == Path("run/metrics.steps.jsonl")
    assert steps_file("m") == Path("m.steps.jsonl") and steps_file("a.b.json") == Path("a.b.steps.jsonl")
    assert StepTimeRecorder.wanted(2, "m.jsonl") and not StepTimeRecorder.wanted(1, "m.jsonl")
    assert not StepTimeRecorder.wanted(2, None)
