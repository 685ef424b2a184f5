"""--torch-compile against eager, side by side: the training step's time compiled / eager on the CPU, and what
compiling cost.

One process, the bench model (bench/common.py: GPT-2 style, 4 layers, hidden 256, 8 heads, 128 tokens, micro-batch
4, fp32, dropout off), two Trainers with the same seed and data: one eager, one with ``--torch-compile`` (each
layer compiled by inductor, which on the CPU generates C++ and builds it with the system compiler; its graphs are
cached on disk, so a second run compiles faster: ``--fresh-cache`` times a cold compile). The first compiled step
pays the compilation: its time minus an eager step's is printed as the compile time. Then the sides alternate step
by step (bench/common.py's rules) and the ratio is the median of per-round ratios compiled / eager, with its IQR;
below 1.0 compiled is faster. Both sides' first-step losses are printed (equal to float32 rounding: inductor fuses
and reorders the arithmetic).

    python bench/compile_bench.py [--iters 20] [--threads 1] [--output FILE] [--fresh-cache] [--layers 4 ...]

About 3 minutes on 2 idle cores, most of it the compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import common
import torch

from megalite import parallel_state
from megalite.training import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--fresh-cache", action="store_true", help="compile into an empty inductor cache")
    parser.add_argument("--output", default=None, help="also write the table to this markdown file")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: all cores; 1 on a shared machine, where waiting threads spin)")
    args = parser.parse_args()
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_")
    threads = common.set_threads(1) if args.threads is None else args.threads
    torch.set_num_threads(threads)
    parallel_state.initialize_model_parallel(1, 1)
    eager_cfg = common.training_config(args, micro_batches=1)
    compiled_cfg = dataclasses.replace(eager_cfg, kernels=dataclasses.replace(
        eager_cfg.kernels, torch_compile=True, torch_compile_backend=args.backend))
    trainers = {"eager": Trainer.on_registered_layout(eager_cfg, common.CPU),
                "compiled": Trainer.on_registered_layout(compiled_cfg, common.CPU)}
    first = {}
    for name, trainer in trainers.items():
        start = time.perf_counter()
        loss = trainer.train_step()["loss"]
        first[name] = (time.perf_counter() - start, loss)
    print(f"first-step losses: eager {first['eager'][1]:.6f}, compiled {first['compiled'][1]:.6f}; "
          f"{threads} threads, load average {common.load_average():.1f}", flush=True)
    times = common.alternate({name: trainer.train_step for name, trainer in trainers.items()},
                             warmup=args.warmup, iters=args.iters)
    eager_ms, compiled_ms = statistics.median(times["eager"]), statistics.median(times["compiled"])
    compile_s = first["compiled"][0] - eager_ms / 1e3
    low, high = common.ratio_spread(times["compiled"], times["eager"])
    lines = [f"# --torch-compile ({args.backend}) against eager, one process on the CPU",
             "",
             f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, {args.seq} tokens, "
             f"micro-batch {args.micro_batch}, fp32; {len(times['eager'])} rounds; {threads} threads; "
             f"torch {torch.__version__}",
             "",
             "| eager ms/step | compiled ms/step | compiled / eager (median, IQR) | compile time s |",
             "|---:|---:|---:|---:|",
             f"| {eager_ms:.1f} | {compiled_ms:.1f} | {common.paired_ratio(times['compiled'], times['eager']):.2f} "
             f"({low:.2f}-{high:.2f}) | {compile_s:.1f} |"]
    common.print_table(lines, args.output)


if __name__ == "__main__":
    main()
