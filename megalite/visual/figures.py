"""Making and saving figures: matplotlib's object-oriented API only (``Figure``, never ``pyplot``), so nothing here
picks a display backend or keeps figures alive in a global registry; a file's format follows its suffix.

Without matplotlib, :func:`new_figure` raises a one-line ConfigError naming the extra that installs it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from megalite.config import ConfigError

FORMATS = (".png", ".svg", ".pdf")
MISSING = 'drawing needs matplotlib, which is not installed: pip install -e ".[plot]" (or pip install matplotlib)'

# One colour per step kind (F forward, B backward or input gradient, W weight gradient); a kind not listed gets the
# default. The memory segments' colours are in megalite.visual.memory.
KIND_COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#8172b2"}
DEFAULT_COLOUR = "#8c8c8c"


def check_output(path: str | Path) -> Path:
    """``path`` if its suffix is one we write (PNG, SVG, PDF) and matplotlib is there to write it, else a
    ConfigError saying which is not so (tools call it before their work, so a bad --output costs nothing)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ConfigError(f"{path}: a figure is written as {', '.join(FORMATS)} (by the file's suffix), not "
                          f"{path.suffix or 'a file without a suffix'}")
    try:
        installed = importlib.util.find_spec("matplotlib") is not None   # found, not imported: cheap
    except ValueError:   # in sys.modules as None: import would fail
        installed = False
    if not installed:
        raise ConfigError(MISSING)
    return path


def new_figure(width_in: float, height_in: float, constrained: bool = True):
    """A matplotlib Figure of that size in inches (100 dpi), laid out by matplotlib's constrained layout unless the
    caller places its axes itself (cheaper: the layout costs about a second per save on a busy CPU)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(MISSING) from None
    return Figure(figsize=(width_in, height_in), dpi=100, layout="constrained" if constrained else None)


def save(figure, path: str | Path) -> Path:
    """Write ``figure`` to ``path`` (format by suffix; the folder is made if missing); returns the path."""
    path = check_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def lighter(colour: str, amount: float) -> str:
    """``colour`` (``#rrggbb``) mixed with white: 0 keeps it, 1 is white."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def text_colour(colour: str) -> str:
    """Black or white, whichever reads better on ``colour`` (by its luminance)."""
    r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"
