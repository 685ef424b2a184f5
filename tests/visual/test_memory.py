"""Memory bars: each bar is the planner's estimate, segment for segment (their heights sum to its total), for the
top layouts of a plan (the chosen one marked) and for each stage of a --dry-run, through both command lines."""

from __future__ import annotations

import pytest

import pretrain_gpt
from megalite.planner import Hardware, Layout, load_model_config, search, stage_memory
from megalite.planner.hardware import GiB
from megalite.visual.memory import layout_label, plan_figure, segments

from .helpers import needs_matplotlib, svg_ids, tool


@pytest.fixture(scope="module")
def plan():
    return search(load_model_config("gpt2_medium"), Hardware(num_gpus=4, gpu_memory_gib=12), 64,
                  model_name="gpt2_medium")


def bar_heights(axes, bar: int) -> float:
    return sum(p.get_height() for p in axes.patches if (p.get_gid() or "").startswith(f"memory-{bar}-"))


def test_segments_are_the_planners_terms():
    model = load_model_config("gpt2_medium")
    for layout in (Layout(dp=8, zero=3), Layout(tp=2, pp=2, dp=2, zero=1, recompute="selective"), Layout()):
        for rank in range(layout.pp):
            memory = stage_memory(model, layout, rank, 64)
            assert sum(value for _, value in segments(memory)) == pytest.approx(memory.total, rel=1e-12)
    assert dict(segments(stage_memory(model, Layout(dp=8, zero=3), 0, 64)))["gathered"] > 0
    assert layout_label(Layout(tp=2, pp=4, virtual_stages=2, dp=2, zero=1, sequence_parallel=True,
                               recompute="selective")) == "TP=2 PP=4 V=2\nDP=2 mbs 1\nZeRO-1 SP sel."


def test_a_plan_draws_its_top_layouts_chosen_first(plan, tmp_path, capsys):
    needs_matplotlib()
    figure = plan_figure(plan, top=4)
    axes = figure.axes[0]
    shown = plan.ranked[:4]
    assert len(shown) == 4 and [t.get_text() for t in axes.get_xticklabels()] == [layout_label(e.layout) for e in
                                                                                   shown]
    for i, e in enumerate(shown):
        assert bar_heights(axes, i) == pytest.approx(e.peak.total / GiB)
    assert [t.get_fontweight() for t in axes.get_xticklabels()] == ["bold", "normal", "normal", "normal"]
    # The command line's --plot.
    argv = ["--model", "gpt2_medium", "--gpus", "4", "--gpu-memory-gib", "12", "--global-batch-size", "64",
            "--top", "3", "--plot", str(tmp_path / "plan.svg")]
    assert tool("plan_parallelism").main(argv) == 0
    assert {i.split("-")[1] for i in svg_ids(tmp_path / "plan.svg", "memory-")} == {"0", "1", "2"}
    assert f"wrote {tmp_path / 'plan.svg'}" in capsys.readouterr().err
    assert tool("plan_parallelism").main(argv[:-1] + [str(tmp_path / "plan.bmp")]) == 2   # before any search
    assert capsys.readouterr().err.startswith("plan_parallelism: error: ") and not (tmp_path / "plan.bmp").exists()


def test_a_dry_run_draws_each_stage(tmp_path, monkeypatch, capsys):
    needs_matplotlib()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    argv = ["model=gpt_tiny", "data=mock", "--num-layers", "4", "--pipeline-model-parallel-size", "4", "--dry-run",
            "--plot", str(tmp_path / "stages.svg")]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "megalite: dry run: TP=1 x PP=4 x DP=1" in out and f"wrote {tmp_path / 'stages.svg'}" in out
    ids = svg_ids(tmp_path / "stages.svg", "memory-")
    assert {i.split("-")[1] for i in ids} == {"0", "1", "2", "3"}
    assert pretrain_gpt.main(argv[:-2] + ["--plot", str(tmp_path / "stages.gif")]) == 2
    assert "stages.gif: a figure is written as .png, .svg, .pdf" in capsys.readouterr().err
