"""Draw a pipeline timeline: one row per pipeline rank, one box per step, the bubble in the title beside the theory.

    python tools/plot_schedule.py --pipeline-model-parallel-size 4 --num-micro-batches 8 --output 1f1b.png
    python tools/plot_schedule.py --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 \\
        --num-micro-batches 8 --costs F=1 B=2 --output interleaved.png interleaved.svg
    python tools/plot_schedule.py --pipeline-schedule zbv --pipeline-model-parallel-size 4 --output zbv.png
    python tools/plot_schedule.py --steps-file run/metrics.steps.jsonl --iteration 20 --output measured.png

The first three simulate megalite's own orderings (megalite.pipeline.schedules) at unit costs or the ``--costs`` given
per step kind (F forward, B backward: its input-gradient part where a schedule has W steps, W the weight gradient;
a schedule without W steps does both in B, which then costs B + W). The last draws what a run measured: train with
``--timing-log-level 2 --metrics-file run/metrics.jsonl`` and each logged iteration's step times are in
``run/metrics.steps.jsonl`` (the last one is drawn unless ``--iteration`` says which). PNG, SVG or PDF by suffix;
needs matplotlib (pip install -e ".[plot]").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megalite.config import ConfigError  # noqa: E402
from megalite.config.tool import check_writable, run_tool  # noqa: E402
from megalite.pipeline.schedules import SCHEDULES, build_schedule, placement_of  # noqa: E402
from megalite.visual.figures import check_output, save  # noqa: E402
from megalite.visual.timeline import (UNIT_COSTS, Timeline, draw_timeline, from_recorded,  # noqa: E402
                                      read_recorded, simulate, step_costs, theory_bubble)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plot_schedule", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--output", "-o", nargs="+", required=True, metavar="FILE",
                        help="Figure file(s): .png, .svg or .pdf.")
    schedule = parser.add_argument_group("a schedule, simulated")
    schedule.add_argument("--pipeline-model-parallel-size", type=int, default=4, metavar="PP",
                          help="Pipeline ranks (default 4).")
    schedule.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=1, metavar="V",
                          help="Model chunks per rank: V > 1 interleaves the schedule (default 1; zbv: 2).")
    schedule.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b",
                          help="1f1b (interleaved when V > 1), zero-bubble (ZB-H1) or zbv (ZB-V), as training's flag.")
    schedule.add_argument("--num-micro-batches", type=int, default=8, metavar="M",
                          help="Micro-batches per step (default 8).")
    schedule.add_argument("--costs", nargs="+", default=[], metavar="KIND=COST",
                          help="Cost of a step of each kind, e.g. F=1 B=2 (default 1 each: F=1 B=1 W=1).")
    measured = parser.add_argument_group("or a run's measured step times")
    measured.add_argument("--steps-file", metavar="FILE",
                          help="The FILE.steps.jsonl a run with --timing-log-level 2 wrote beside its metrics file.")
    measured.add_argument("--iteration", type=int, help="The recorded iteration to draw (default: the last).")
    return parser.parse_args(argv)


def _costs(words: list[str]) -> dict[str, float]:
    costs = dict(UNIT_COSTS)
    for word in words:
        kind, sep, value = word.partition("=")
        try:
            costs[kind] = float(value)
        except ValueError:
            sep = ""
        if not sep or not kind or costs[kind] <= 0:
            raise ConfigError(f"--costs wants KIND=COST with a cost > 0, e.g. F=1 B=2, got {word!r}")
    return costs


_NAMES = {"1f1b": "1F1B", "zero-bubble": "ZB-H1", "zbv": "ZB-V"}


def _schedule_name(pp: int, v: int, schedule: str = "1f1b") -> str:
    if pp == 1:
        return "no pipelining"
    return f"interleaved {_NAMES[schedule]}" if v > 1 and schedule != "zbv" else _NAMES[schedule]


def _layout(pp: int, v: int, m: int) -> str:
    return f"PP={pp}" + (f" x V={v}" if v > 1 else "") + f", M={m}"


def simulated(args: argparse.Namespace) -> tuple[Timeline, str, str]:
    """(timeline, title, summary) of the schedule the options describe."""
    pp, v, m = args.pipeline_model_parallel_size, args.num_virtual_stages_per_pipeline_rank, args.num_micro_batches
    if pp < 1 or v < 1 or m < 1:
        raise ConfigError(f"PP, V and M must be >= 1, got {pp}, {v} and {m}")
    if v > 1 and pp == 1:
        raise ConfigError("virtual stages need --pipeline-model-parallel-size > 1")
    name = args.pipeline_schedule
    if name == "zbv":   # its v-shape: two chunks per rank
        if v not in (1, 2):
            raise ConfigError(f"zbv holds 2 chunks per rank, not --num-virtual-stages-per-pipeline-rank {v}")
        v = 2 if pp > 1 else 1
    costs = _costs(args.costs)
    try:
        schedules = [build_schedule(pp, rank, m, v, name) for rank in range(pp)]
    except ValueError as error:
        raise ConfigError(str(error)) from None
    timeline = simulate(schedules, costs, placement_of(name) if pp > 1 else "round-robin")
    shown = ", ".join(f"{kind} {cost:g}" for kind, cost in step_costs(schedules, costs).items())
    return (timeline, f"{_schedule_name(pp, v, name)}, {_layout(pp, v, m)}, step costs {shown}",
            _theory(name, pp, m, v))


def _theory(schedule: str, pp: int, m: int, v: int) -> str:
    known = theory_bubble(schedule, pp, m, v)
    return f"theory {known[1]} = {known[0]:.1%} at equal stage costs" if known else "no formula known"


def recorded(args: argparse.Namespace) -> tuple[Timeline, str, str]:
    """(timeline, title, summary) of the recorded iteration the options name."""
    record = read_recorded(args.steps_file, args.iteration)
    pp, v, m = record["pipeline_model_parallel_size"], record["virtual_stages"], record["num_micro_batches"]
    name = _schedule_name(pp, v, record.get("schedule", "1f1b"))
    title = f"measured at iteration {record['iteration']}: {name}, {_layout(pp, v, m)}"
    return from_recorded(record), title, _theory(record.get("schedule", "1f1b"), pp, m, v)


def main(argv: list[str]) -> int:
    args = parse(argv)
    return run_tool("plot_schedule", lambda: plot(args))


def plot(args: argparse.Namespace) -> int:
    """The work; run_tool reports its errors."""
    outputs = [check_writable(check_output(path)) for path in args.output]
    timeline, title, theory = recorded(args) if args.steps_file else simulated(args)
    figure = draw_timeline(timeline, f"{title}\nbubble {timeline.bubble:.1%} ({theory})")
    for path in outputs:
        save(figure, path)
    print(f"wrote {', '.join(map(str, outputs))}: {len(timeline.ranks)} ranks, "
          f"{sum(len(steps) for steps in timeline.ranks)} steps, bubble {timeline.bubble:.1%} ({theory})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
