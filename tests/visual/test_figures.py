"""Figures' plumbing: formats by suffix, and without matplotlib a one-line error naming the extra to install."""

from __future__ import annotations

import sys

import pytest

from megalite.config import ConfigError
from megalite.visual.figures import check_output, lighter, new_figure, text_colour

from .helpers import tool


def test_formats_by_suffix(tmp_path):
    assert check_output(tmp_path / "a.SVG").suffix == ".SVG"
    with pytest.raises(ConfigError, match=r"a\.gif: a figure is written as \.png, \.svg, \.pdf"):
        check_output(tmp_path / "a.gif")


def test_without_matplotlib_one_line_names_the_extra(monkeypatch, tmp_path, capsys):
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # what an absent package looks like to import
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[plot\]"'):
        new_figure(4, 3)
    assert tool("plot_schedule").main(["--output", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plot_schedule: error: drawing needs matplotlib") and err.count("\n") == 1
    assert not (tmp_path / "a.png").exists()


def test_colours():
    assert lighter("#204080", 0.0) == "#204080" and lighter("#204080", 1.0) == "#ffffff"
    assert text_colour("#4c72b0") == "white" and text_colour("#eeeeee") == "black"
