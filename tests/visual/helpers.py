"""What the figure tests share: the tools imported from tools/, and what a written SVG names."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool(name: str):
    """The module of tools/<name>.py (its ``main(argv)`` runs in this process)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    return __import__(name)


def svg_ids(path: Path, prefix: str) -> list[str]:
    """The ids in an SVG file that start with ``prefix`` (matplotlib writes an artist's gid as its element's id)."""
    return re.findall(rf'id="({re.escape(prefix)}[^"]*)"', path.read_text())


def needs_matplotlib():
    return pytest.importorskip("matplotlib", reason="drawing needs matplotlib (pip install -e '.[plot]')")
