"""Runs compared: metrics files read (evaluations placed at their iteration's samples and tokens, repeated
iterations of a resumed run taking the later value), the largest relative difference of each quantity found where
it is, one panel per quantity present, and the command line."""

from __future__ import annotations

import json

import pytest

from megalite.config import ConfigError
from megalite.visual.figures import save
from megalite.visual.metrics import Run, draw_metrics, labels_for, largest_differences, read_metrics, series

from .helpers import needs_matplotlib, tool


def write_run(path, losses, grad_norm=1.0, tokens_per_sec=1000.0, eval_at=None):
    lines = []
    for i, loss in enumerate(losses, start=1):
        lines.append({"iteration": i, "loss": loss, "grad_norm": grad_norm, "lr": 1e-3 * i, "consumed_samples": 8 * i,
                      "consumed_tokens": 256 * i, "tokens_per_sec": tokens_per_sec, "elapsed_ms": 10.0})
        if i == eval_at:
            lines.append({"iteration": i, "eval_loss": loss + 0.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_series_and_the_largest_difference(tmp_path):
    a = Run("a", tuple(read_metrics(write_run(tmp_path / "a.jsonl", [4.0, 3.0, 2.0], eval_at=2))))
    b = Run("b", tuple(read_metrics(write_run(tmp_path / "b.jsonl", [4.0, 3.3, 2.0], tokens_per_sec=1500.0,
                                              eval_at=2))))
    assert series(a, "eval_loss", "tokens") == {512.0: 3.5} and series(a, "loss", "samples")[24.0] == 2.0
    found = {d.key: d for d in largest_differences([a, b], "iteration")}
    assert found["loss"].relative == pytest.approx(0.1) and found["loss"].at == 2 and found["loss"].run == "b"
    assert found["eval_loss"].relative == pytest.approx(0.3 / 3.5)
    assert found["tokens_per_sec"].relative == pytest.approx(0.5) and found["grad_norm"].relative == 0.0
    assert "mfu" not in found
    resumed = Run("r", a.records + ({"iteration": 3, "loss": 9.0, "consumed_samples": 24},))
    assert series(resumed, "loss")[3.0] == 9.0   # the later record of a repeated iteration wins


def test_reading_refuses_what_is_not_a_metrics_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"iteration": 1, "loss": 2}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not a metrics record"):
        read_metrics(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="cannot read it"):
        read_metrics(tmp_path / "missing.jsonl")
    assert labels_for(["x/run.jsonl", "y/run.jsonl"]) == ["x/run", "y/run"]
    assert labels_for(["fp8.jsonl", "bf16.jsonl"]) == ["fp8", "bf16"]


def test_the_figure_and_the_command_line(tmp_path, capsys):
    needs_matplotlib()
    a, b = write_run(tmp_path / "a.jsonl", [4.0, 3.0, 2.0], eval_at=3), write_run(tmp_path / "b.jsonl", [4.0, 3.0, 2.2])
    figure = draw_metrics([Run("a", tuple(read_metrics(a))), Run("b", tuple(read_metrics(b)))])
    titles = [axes.get_title() for axes in figure.axes if axes.get_visible()]
    assert titles == ["loss", "eval loss", "gradient norm", "learning rate", "tokens/s"]
    assert [len(line.get_xdata()) for line in figure.axes[0].get_lines()] == [3, 3]
    assert save(figure, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    plot_metrics = tool("plot_metrics")   # (its --output is draw_metrics and save, as above)
    assert plot_metrics.main([str(a), str(b), "--x", "tokens"]) == 0
    out = capsys.readouterr().out
    assert "largest relative difference from a:" in out and "loss            0.1 (b at consumed tokens 768)" in out
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"iteration": 1, "loss": 3.0, "consumed_samples": 8}) + "\n")
    assert plot_metrics.main([str(a), str(old), "--x", "tokens"]) == 2
    assert "old.jsonl: no consumed_tokens in its records" in capsys.readouterr().err
    assert plot_metrics.main([str(a), str(b), "--labels", "one"]) == 2
