"""Draw several runs' metrics on one figure and print the largest relative difference of each quantity.

    python tools/plot_metrics.py run_tp2/metrics.jsonl run_pp2/metrics.jsonl --output compare.png
    python tools/plot_metrics.py bf16.jsonl fp8.jsonl --x tokens --labels bf16 fp8 --output fp8.svg

Each file is a run's --metrics-file. One panel per quantity some run has (loss, eval loss, gradient norm, learning
rate, tokens/s, MFU), one line per run, against the iteration (default), the consumed samples or the consumed
tokens. The differences are each run's against the first, where both have a point at the same x: e.g. two layouts
of the same run should agree in loss and gradient norm to ~1e-6 and differ in tokens/s. Without --output only the
differences are printed. Figures are PNG, SVG or PDF by suffix; drawing needs matplotlib (pip install -e ".[plot]").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megalite.config import ConfigError  # noqa: E402
from megalite.config.tool import check_writable, run_tool  # noqa: E402
from megalite.visual.figures import check_output, save  # noqa: E402
from megalite.visual.metrics import (X_KEYS, X_LABELS, Run, check_x, draw_metrics, labels_for,  # noqa: E402
                                     largest_differences, read_metrics)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plot_metrics", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("files", nargs="+", metavar="METRICS.jsonl", help="Metrics files, the reference first.")
    parser.add_argument("--output", "-o", nargs="+", default=[], metavar="FILE",
                        help="Figure file(s): .png, .svg or .pdf.")
    parser.add_argument("--x", choices=sorted(X_KEYS), default="iteration", help="The x axis (default iteration).")
    parser.add_argument("--labels", nargs="+", metavar="NAME", help="One name per file (default: from the paths).")
    parser.add_argument("--title", help="A title for the figure.")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    return run_tool("plot_metrics", lambda: plot(args))


def plot(args: argparse.Namespace) -> int:
    """The work; run_tool reports its errors."""
    outputs = [check_writable(check_output(path)) for path in args.output]
    labels = args.labels or labels_for(args.files)
    if len(labels) != len(args.files):
        raise ConfigError(f"--labels gives {len(labels)} names for {len(args.files)} files")
    runs = [Run(label, tuple(read_metrics(path))) for label, path in zip(labels, args.files)]
    check_x(runs, args.x, args.files)
    if outputs:
        figure = draw_metrics(runs, args.x, args.title)
        for path in outputs:
            save(figure, path)
        print(f"wrote {', '.join(map(str, outputs))}")
    if len(runs) > 1:
        print(f"largest relative difference from {runs[0].label}:")
        for d in largest_differences(runs, args.x):
            print(f"  {d.key:<15} {d.relative:.3g} ({d.run} at {X_LABELS[args.x]} {d.at:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
