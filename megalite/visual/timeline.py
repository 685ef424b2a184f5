"""Pipeline timelines: when each pipeline rank runs each step of a schedule, and the bubble that leaves.

A timeline comes from one of two places:

- :func:`simulate`: the pure orderings of megalite.pipeline.schedules (one list of steps per rank) at given costs per
  step kind. Each rank runs its steps in order, each as soon as the rank is free and the step's input exists: an F
  after the previous stage's F of its micro-batch; a B after the next stage's B (on the last stage, after its own
  F); any other kind, such as zero-bubble's W, after the B of its micro-batch on its stage. Transfers are free. B is
  the backward's input-gradient part and W its weight-gradient part: a schedule without W steps does both in B, which
  then costs B + W (unit costs thus give 1F1B its usual backward of twice a forward). The placement says which
  virtual stage a rank's chunk is (Megatron's interleaving, chunk c of rank r is stage c PP + r; ZB-V's v-shape).
  The timing itself is megalite.pipeline.simulation's.
- :func:`from_recorded`: the step times a run recorded (``--timing-log-level 2``, megalite.training.step_times).

The bubble is each rank's idle time over its compute time up to the end of the last rank (the optimizer step waits
for it), averaged over ranks, as the metrics file's ``pipeline_bubble``: at equal step costs and M >= PP, (PP - 1) /
(V M) for 1F1B and interleaved 1F1B (Narayanan et al. 2021), (PP - 1) / (3 V M) for zero-bubble and (PP - 1) / (6 M)
for ZB-V (Qi et al. 2023).

:func:`draw_timeline` draws one row per rank (rank 0 on top), one box per step coloured by kind (a chunk's shade
lighter the later the chunk), its micro-batch number inside, on a grey band: what shows grey is idle time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from megalite.config import ConfigError
from megalite.pipeline.simulation import BUBBLE_FORMULAS, UNIT_COSTS, bubble_formula, run_steps
from megalite.visual.figures import DEFAULT_COLOUR, KIND_COLOURS, lighter, new_figure, text_colour
from megalite.visual.records import read_records


@dataclass(frozen=True)
class TimedStep:
    kind: str
    chunk: int
    micro_batch: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    ranks: tuple[tuple[TimedStep, ...], ...]   # each pipeline rank's steps, in the order run
    unit: str = "unit step costs"             # what the times are in

    @property
    def makespan(self) -> float:
        return max((steps[-1].end for steps in self.ranks if steps), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.ranks[rank])

    @property
    def bubble(self) -> float:
        """Idle over compute time up to the last rank's end, averaged over the ranks (see the module docstring)."""
        fractions = [(self.makespan - busy) / busy for busy in map(self.busy, range(len(self.ranks))) if busy > 0]
        return sum(fractions) / len(fractions) if fractions else 0.0

    @property
    def num_chunks(self) -> int:
        return 1 + max((s.chunk for steps in self.ranks for s in steps), default=0)


def theory_bubble(schedule: str, pp: int, num_micro_batches: int,
                  virtual_stages: int = 1) -> Optional[tuple[float, str]]:
    """(bubble, formula) the papers give ``schedule`` at equal step costs (megalite.pipeline.simulation), or None
    where none is known."""
    if schedule not in BUBBLE_FORMULAS:
        return None
    return bubble_formula(schedule, pp, num_micro_batches, virtual_stages), BUBBLE_FORMULAS[schedule]


def step_costs(schedules: Sequence[Sequence], costs: Mapping[str, float] = UNIT_COSTS) -> dict[str, float]:
    """What each kind of step costs in ``schedules``: ``costs``, but B + W for B where no step is a W."""
    cost = {kind: float(c) for kind, c in costs.items()}
    if not any(s.kind == "W" for steps in schedules for s in steps):
        cost["B"] = cost.get("B", 1.0) + cost.pop("W", 1.0)
    return cost


def simulate(schedules: Sequence[Sequence], costs: Mapping[str, float] = UNIT_COSTS,
             placement: str = "round-robin") -> Timeline:
    """Time every rank's steps (``schedules[rank]``) as megalite.pipeline.simulation does, keeping each step's
    start and end; ``placement`` says which virtual stage each rank's chunk is (megalite.pipeline.partition). Raises
    ValueError if the schedules cannot finish."""
    chunks = 1 + max((s.chunk for steps in schedules for s in steps), default=0)
    timed = run_steps([list(steps) for steps in schedules], len(schedules), chunks, placement, dict(costs))
    return Timeline(tuple(tuple(TimedStep(s.kind, s.chunk, s.micro_batch, start, end) for s, start, end in steps)
                          for steps in timed))


def read_recorded(path: str | Path, iteration: Optional[int] = None) -> dict:
    """The record of ``iteration`` (default: the last one) in a run's step-times file."""
    records = read_records(path, "step-times record")
    if iteration is not None:
        records = [r for r in records if r["iteration"] == iteration]
    if not records:
        raise ConfigError(f"{path}: no step times of iteration {iteration}")
    return records[-1]


def from_recorded(record: dict) -> Timeline:
    """The timeline of one line of a run's step-times file (megalite.training.step_times), in milliseconds."""
    columns = record.get("columns", ["kind", "chunk", "micro_batch", "start_ms", "end_ms"])
    ranks = []
    for steps in record["ranks"]:
        rows = [dict(zip(columns, row)) for row in steps]
        ranks.append(tuple(TimedStep(str(r["kind"]), int(r["chunk"]), int(r["micro_batch"]), float(r["start_ms"]),
                                     float(r["end_ms"])) for r in rows))
    return Timeline(tuple(ranks), unit="ms")


def kind_colour(kind: str, chunk: int = 0, num_chunks: int = 1) -> str:
    """A step's colour: its kind's (or the default), lighter for later chunks."""
    base = KIND_COLOURS.get(kind, DEFAULT_COLOUR)
    return lighter(base, 0.55 * chunk / max(num_chunks - 1, 1)) if num_chunks > 1 else base


def draw_timeline(timeline: Timeline, title: str):
    """The figure (see the module docstring); each box's gid is ``step-<rank>-<index>``, so an SVG names them."""
    pp, span = len(timeline.ranks), timeline.makespan or 1.0
    width, height = 11.0, 0.45 * pp + 1.3
    figure = new_figure(width, height, constrained=False)   # first: one line if matplotlib is missing
    from matplotlib.patches import Patch, Rectangle

    # Margins in inches: rank names on the left, the legend on the right, the title's two lines above.
    left, right, top, bottom = 0.75, 2.0, 0.6, 0.55
    axes = figure.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (top + bottom) / height))
    chunks = timeline.num_chunks
    # Box labels fit where a box is wide enough for their digits: its share of the axes' width in points.
    points_per_unit = 72 * (width - left - right) / span
    for rank, steps in enumerate(timeline.ranks):
        axes.axhspan(rank - 0.4, rank + 0.4, color="#eeeeee", linewidth=0)   # idle time shows grey
        for index, s in enumerate(steps):
            colour = kind_colour(s.kind, s.chunk, chunks)
            box = Rectangle((s.start, rank - 0.4), s.end - s.start, 0.8, facecolor=colour, edgecolor="white",
                            linewidth=0.6)
            box.set_gid(f"step-{rank}-{index}")
            axes.add_patch(box)
            box_points = (s.end - s.start) * points_per_unit
            label = str(s.micro_batch)
            if box_points >= 5.5 * len(label) + 3:
                axes.text((s.start + s.end) / 2, rank, label, ha="center", va="center",
                          fontsize=min(8.0, box_points / (0.65 * len(label) + 0.6)), color=text_colour(colour))
    axes.set_xlim(0, span)
    axes.set_ylim(pp - 0.5, -0.5)
    axes.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    axes.set_xlabel(f"time ({timeline.unit})")
    axes.set_title(title, fontsize=10)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    kinds = sorted({s.kind for steps in timeline.ranks for s in steps}, key=lambda k: ("FBW".find(k) % 9, k))
    names = {"F": "forward", "B": "input grad." if "W" in kinds else "backward", "W": "weight grad."}
    handles = []
    for kind in kinds:
        for chunk in range(chunks):
            suffix = f", chunk {chunk}" if chunks > 1 else ""
            handles.append(Patch(facecolor=kind_colour(kind, chunk, chunks),
                                 label=f"{kind} {names.get(kind, '')}".rstrip() + suffix))
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return figure
