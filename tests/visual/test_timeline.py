"""Pipeline timelines: the simulation of megalite's own orderings gives the papers' bubbles (1F1B, interleaved, a
zero-bubble order with W steps and a kind the drawing has no colour for), recorded times read back, and the figure
has one row per rank and one box per step (counted in the SVG it writes)."""

from __future__ import annotations

import pytest

from megalite.pipeline.schedules import Step, build_schedule
from megalite.pipeline.schedules import placement_of
from megalite.pipeline.simulation import bubble_formula
from megalite.visual.figures import DEFAULT_COLOUR, KIND_COLOURS
from megalite.visual.timeline import draw_timeline, from_recorded, kind_colour, simulate, step_costs, theory_bubble

from .helpers import needs_matplotlib, svg_ids, tool


def schedules(pp: int, m: int, v: int = 1) -> list[list[Step]]:
    return [build_schedule(pp, rank, m, v) for rank in range(pp)]


@pytest.mark.parametrize("pp, m, v", [(2, 4, 1), (4, 8, 1), (4, 4, 1), (4, 8, 2), (2, 6, 3), (1, 3, 1)])
def test_unit_cost_bubbles_are_the_papers(pp, m, v):
    steps = schedules(pp, m, v)
    timeline = simulate(steps)
    assert len(timeline.ranks) == pp
    for rank in range(pp):   # every step, in the order the schedule gives, none overlapping the previous
        assert [(s.kind, s.chunk, s.micro_batch) for s in timeline.ranks[rank]] == \
            [(s.kind, s.chunk, s.micro_batch) for s in steps[rank]]
        assert all(a.end <= b.start for a, b in zip(timeline.ranks[rank], timeline.ranks[rank][1:]))
    assert timeline.bubble == pytest.approx(bubble_formula("1f1b", pp, m, v))
    assert theory_bubble("1f1b", pp, m, v)[0] == pytest.approx(timeline.bubble)
    # No W steps: B does the whole backward, B + W.
    assert step_costs(steps) == {"F": 1.0, "B": 2.0}
    assert timeline.makespan == pytest.approx(3 * m * v * (1 + timeline.bubble))


def test_a_zero_bubble_order_with_weight_gradient_steps():
    # ZB-H1 at PP=2, M=2 by hand: rank 1 defers one W. At unit costs, by hand: rank 0 F0 0-1, F1 1-2, B0 3-4,
    # W0 4-5, B1 5-6, W1 6-7; rank 1 F0 1-2, B0 2-3, F1 3-4, B1 4-5, W0 5-6, W1 6-7: bubble 1/6 = (PP-1)/(3M).
    order = [["F0", "F1", "B0", "W0", "B1", "W1"], ["F0", "B0", "F1", "B1", "W0", "W1"]]
    steps = [[Step(word[0], 0, int(word[1])) for word in rank] for rank in order]
    timeline = simulate(steps)
    assert [(s.start, s.end) for s in timeline.ranks[0]] == [(0, 1), (1, 2), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert [(s.start, s.end) for s in timeline.ranks[1]] == [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert timeline.bubble == pytest.approx(1 / 6)
    # Another kind (a future one): after the B of its micro-batch, at its given cost; its own colour is the default.
    steps[1].append(Step("R", 0, 1))
    longer = simulate(steps, {"F": 1, "B": 1, "W": 1, "R": 2.5})
    assert longer.ranks[1][-1].start == 7 and longer.makespan == 9.5
    assert kind_colour("R") == DEFAULT_COLOUR and kind_colour("W") == KIND_COLOURS["W"]
    assert kind_colour("F", 1, 2) != kind_colour("F", 0, 2)   # later chunks lighter


@pytest.mark.parametrize("schedule, v", [("zero-bubble", 1), ("zero-bubble", 2), ("zbv", 2)])
def test_zero_bubble_timelines_have_the_papers_bubbles(schedule, v, tmp_path, capsys):
    steps = [build_schedule(4, rank, 8, v, schedule) for rank in range(4)]
    timeline = simulate(steps, placement=placement_of(schedule))
    assert timeline.bubble == pytest.approx(bubble_formula(schedule, 4, 8, v)) == theory_bubble(schedule, 4, 8, v)[0]
    assert any(s.kind == "W" for s in timeline.ranks[0])
    if schedule == "zbv":   # the tool draws it too, its V implied
        needs_matplotlib()
        out = tmp_path / "zbv.svg"
        assert tool("plot_schedule").main(["--pipeline-schedule", "zbv", "--output", str(out)]) == 0
        assert "(PP-1)/(6 M)" in capsys.readouterr().out and len(svg_ids(out, "step-")) == sum(map(len, steps))


def test_a_schedule_that_cannot_finish_is_an_error():
    with pytest.raises(ValueError, match="cannot finish"):
        simulate([[Step("F", 0, 0), Step("B", 0, 0)], [Step("B", 0, 0), Step("F", 0, 0)]])


def test_recorded_times_read_back():
    record = {"iteration": 3, "columns": ["kind", "chunk", "micro_batch", "start_ms", "end_ms"],
              "ranks": [[["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 3.0, 5.0]], [["F", 0, 0, 1.5, 2.0], ["B", 0, 0, 2.0, 3.0]]]}
    timeline = from_recorded(record)
    assert timeline.unit == "ms" and timeline.makespan == 5.0
    assert timeline.bubble == pytest.approx(((5 - 3) / 3 + (5 - 1.5) / 1.5) / 2)


def test_the_figure_has_a_row_per_rank_and_a_box_per_step(tmp_path):
    needs_matplotlib()
    steps = schedules(4, 8, 2)
    figure = draw_timeline(simulate(steps), "interleaved")
    axes = figure.axes[0]
    assert [t.get_text() for t in axes.get_yticklabels()] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert sum(1 for p in axes.patches if (p.get_gid() or "").startswith("step-")) == sum(map(len, steps))
    # The tool: PNG and SVG of the same figure; the SVG names every box.
    out = tmp_path / "t"
    assert tool("plot_schedule").main(["--pipeline-model-parallel-size", "2", "--num-micro-batches", "4",
                                       "--num-virtual-stages-per-pipeline-rank", "2",
                                       "--output", f"{out}.png", f"{out}.svg"]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ids = svg_ids(tmp_path / "t.svg", "step-")
    assert len(ids) == 2 * 2 * 4 * 2 and {i.split("-")[1] for i in ids} == {"0", "1"}


def test_the_tool_draws_recorded_times_and_refuses_bad_input(tmp_path, capsys):
    needs_matplotlib()
    plot_schedule = tool("plot_schedule")
    steps_file = tmp_path / "m.steps.jsonl"
    record = {"iteration": 2, "schedule": "1f1b", "pipeline_model_parallel_size": 2, "virtual_stages": 1,
              "num_micro_batches": 1, "ranks": [[["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 3.0, 5.0]],
                                                 [["F", 0, 0, 1.5, 2.0], ["B", 0, 0, 2.0, 3.0]]]}
    steps_file.write_text(__import__("json").dumps(record) + "\n")
    assert plot_schedule.main(["--steps-file", str(steps_file), "--output", str(tmp_path / "m.svg")]) == 0
    assert "2 ranks, 4 steps, bubble" in capsys.readouterr().out and len(svg_ids(tmp_path / "m.svg", "step-")) == 4
    for argv, message in [(["--steps-file", str(steps_file), "--iteration", "7"], "no step times of iteration 7"),
                          (["--costs", "F=0"], "KIND=COST with a cost > 0"),
                          (["--num-virtual-stages-per-pipeline-rank", "2", "--num-micro-batches", "6"],
                           "multiple of pipeline-model-parallel-size 4")]:
        assert plot_schedule.main(argv + ["--output", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert plot_schedule.main(["--output", str(tmp_path / "x.jpg")]) == 2
    assert ".png, .svg, .pdf" in capsys.readouterr().err
