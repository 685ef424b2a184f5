"""Runs side by side: several metrics files (``--metrics-file``) on one figure, one panel per quantity, and the
largest relative difference of each quantity between any run and the first (the reference).

The quantities are loss, eval loss, gradient norm, learning rate, tokens/s and MFU, each drawn where some run has it,
against the iteration, the consumed samples or the consumed tokens (``consumed_tokens``). An evaluation record has
no sample count, so it takes that of its iteration's training record. A run resumed into the same file repeats
iterations: the later value wins. Differences are compared where both runs have a point at the same x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megalite.config import ConfigError
from megalite.visual.figures import new_figure
from megalite.visual.records import read_records

PANELS = (("loss", "loss"), ("eval_loss", "eval loss"), ("grad_norm", "gradient norm"), ("lr", "learning rate"),
          ("tokens_per_sec", "tokens/s"), ("mfu", "MFU"))
X_KEYS = {"iteration": "iteration", "samples": "consumed_samples", "tokens": "consumed_tokens"}
X_LABELS = {"iteration": "iteration", "samples": "consumed samples", "tokens": "consumed tokens"}


@dataclass(frozen=True)
class Run:
    label: str
    records: tuple[dict, ...]


@dataclass(frozen=True)
class Difference:
    key: str
    relative: float       # |run - reference| / |reference| at the worst point
    at: float             # its x
    run: str
    reference: str


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file (megalite.visual.records)."""
    return read_records(path, "metrics record")


def labels_for(paths: Sequence[str | Path]) -> list[str]:
    """Short distinct names: the files' stems, else their folders' names with the stems, else the paths."""
    paths = [Path(p) for p in paths]
    for name in (lambda p: p.stem, lambda p: f"{p.parent.name}/{p.stem}", str):
        labels = [name(p) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{i}: {p}" for i, p in enumerate(paths)]


def series(run: Run, key: str, x: str = "iteration") -> dict[float, float]:
    """{x: value} of ``key`` in ``run`` (see the module docstring for evaluation records and repeats)."""
    x_key = X_KEYS[x]
    by_iteration = {r["iteration"]: r[x_key] for r in run.records if r.get(x_key) is not None}
    points: dict[float, float] = {}
    for record in run.records:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        at = record.get(x_key, by_iteration.get(record["iteration"]))
        if at is not None:
            points[float(at)] = float(value)
    return points


def check_x(runs: Sequence[Run], x: str, paths: Sequence[str | Path]) -> None:
    """Every run has the x axis asked for (``consumed_tokens`` is missing from older metrics files)."""
    for run, path in zip(runs, paths):
        if not any(X_KEYS[x] in r for r in run.records):
            raise ConfigError(f"{path}: no {X_KEYS[x]} in its records: plot against another x")


def relative_difference(value: float, reference: float) -> float:
    if value == reference:
        return 0.0
    return abs(value - reference) / abs(reference) if reference else math.inf


def largest_differences(runs: Sequence[Run], x: str = "iteration") -> list[Difference]:
    """For each quantity some two runs share points of: the largest relative difference of any run from the first."""
    found = []
    reference = runs[0]
    for key, _ in PANELS:
        base = series(reference, key, x)
        worst: Optional[Difference] = None
        for run in runs[1:]:
            other = series(run, key, x)
            for at in sorted(base.keys() & other.keys()):
                difference = relative_difference(other[at], base[at])
                if worst is None or difference > worst.relative:
                    worst = Difference(key, difference, at, run.label, reference.label)
        if worst is not None:
            found.append(worst)
    return found


def draw_metrics(runs: Sequence[Run], x: str = "iteration", title: Optional[str] = None):
    """One panel per quantity some run has, one line per run (the first, the reference, drawn first)."""
    panels = [(key, name) for key, name in PANELS if any(series(run, key, x) for run in runs)]
    if not panels:
        raise ConfigError("the metrics files hold none of: " + ", ".join(key for key, _ in PANELS))
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    width, height = 3.9 * columns + 0.4, 2.3 * rows + (0.8 if title else 0.4)
    figure = new_figure(width, height, constrained=False)
    grid = figure.subplots(rows, columns, squeeze=False)
    figure.subplots_adjust(left=0.75 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                           top=1 - (0.75 if title else 0.35) / height, hspace=0.75, wspace=0.22)
    for index, (key, name) in enumerate(panels):
        axes = grid[index // columns][index % columns]
        for run in runs:
            points = sorted(series(run, key, x).items())
            if points:
                xs, ys = zip(*points)
                axes.plot(xs, ys, marker="o" if len(points) <= 30 else None, markersize=3, linewidth=1.2,
                          label=run.label)
        axes.set_title(name, fontsize=9)
        axes.set_xlabel(X_LABELS[x], fontsize=8)
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
        for side in ("top", "right"):
            axes.spines[side].set_visible(False)
    for index in range(len(panels), rows * columns):
        grid[index // columns][index % columns].set_visible(False)
    grid[0][0].legend(fontsize=8)
    if title:
        figure.suptitle(title, fontsize=10)
    return figure
