"""Where the per-step times go (beside the metrics file) and how the ranks are put on one clock (the recording itself
is tested on 4 ranks in tests/multiprocess/test_step_times.py)."""

from __future__ import annotations

from pathlib import Path

from megalite.pipeline.schedules import Step
from megalite.training.step_times import StepTimeRecorder, on_one_clock, steps_file


def test_the_steps_file_sits_beside_the_metrics_file():
    assert steps_file("run/metrics.jsonl") == Path("run/metrics.steps.jsonl")
    assert steps_file("m") == Path("m.steps.jsonl") and steps_file("a.b.json") == Path("a.b.steps.jsonl")
    assert StepTimeRecorder.wanted(2, "m.jsonl") and not StepTimeRecorder.wanted(1, "m.jsonl")
    assert not StepTimeRecorder.wanted(2, None)


def test_the_ranks_go_on_the_clock_of_the_earliest_one():
    steps = [[Step("F", 0, 0), Step("B", 0, 0)], [Step("F", 0, 0), Step("B", 0, 0)]]
    # Rank 1's schedule started 5 ms after rank 0's (by the wall clock): its times move 5 ms later.
    measured = [(1000.000, [(0.0, 0.001), (0.004, 0.006)]), (1000.005, [(0.0, 0.001), (0.001, 0.002)])]
    ranks = on_one_clock(steps, measured)
    assert ranks == [[["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 4.0, 6.0]], [["F", 0, 0, 5.0, 6.0], ["B", 0, 0, 6.0, 7.0]]]
