"""Time one AdamW step on CPU fp32 parameters: CPUAdamW's C++ kernel, its torch fallback, and torch.optim.AdamW.

    python bench/cpu_adam_bench.py [--numel 10000000] [--tensors 8] [--steps 20] [--threads N]

Prints the minimum and median milliseconds per step of each and the ratio of minimums to the kernel's (> 1: slower
than the kernel). The candidates take turns step by step, so a noisy neighbour slows all of them alike, and the
minimum is the figure to trust on a shared machine. torch's own fused CPU AdamW (fused=True) is included because it
is the thing to beat. A step is memory-bound: the kernel reads 16 bytes and writes 12 per parameter, so the GB/s
column (28 bytes per parameter over the time) says how close each comes to the machine's bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from megalite.optimizer.cpu_adam import CPUAdamW


def _params(numel: int, tensors: int) -> list[torch.Tensor]:
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    params = [torch.randn(n) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.numel()) * 1e-2
    return params


def _time_round_robin(optimizers: dict[str, torch.optim.Optimizer], steps: int) -> dict[str, list[float]]:
    """Milliseconds of each timed step of each optimizer, the optimizers taking turns."""
    for optimizer in optimizers.values():
        for _ in range(3):   # allocates the states and warms the caches and thread pool
            optimizer.step()
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(steps):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000, help="parameters in all")
    parser.add_argument("--tensors", type=int, default=8, help="number of tensors the parameters are split into")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each optimizer")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    kwargs = dict(lr=1e-3, weight_decay=0.1)
    start = time.perf_counter()
    kernel_ok = CPUAdamW([torch.zeros(1)], use_kernel=None).use_kernel
    print(f"extension load (build on first run): {time.perf_counter() - start:.1f} s, kernel available: {kernel_ok}")
    candidates: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "CPUAdamW kernel": lambda p: CPUAdamW(p, use_kernel=True, **kwargs),
        "CPUAdamW fallback": lambda p: CPUAdamW(p, use_kernel=False, **kwargs),
        "torch AdamW foreach=False": lambda p: torch.optim.AdamW(p, foreach=False, **kwargs),
        "torch AdamW foreach=True": lambda p: torch.optim.AdamW(p, foreach=True, **kwargs),
        "torch AdamW fused=True": lambda p: torch.optim.AdamW(p, fused=True, **kwargs),
    }
    if not kernel_ok:
        del candidates["CPUAdamW kernel"]
    print(f"{args.numel:,} params in {args.tensors} tensors, {torch.get_num_threads()} threads, {args.steps} steps "
          f"each (min / median ms)")
    optimizers = {name: make(_params(args.numel, args.tensors)) for name, make in candidates.items()}
    times = _time_round_robin(optimizers, args.steps)
    base = min(times["CPUAdamW kernel"]) if kernel_ok else None
    for name, ms in times.items():
        ratio = f"{min(ms) / base:5.2f}x kernel" if base else ""
        print(f"  {name:27s} {min(ms):8.2f} / {statistics.median(ms):8.2f} ms  "
              f"{28 * args.numel / min(ms) / 1e6:6.1f} GB/s  {ratio}")


if __name__ == "__main__":
    main()
