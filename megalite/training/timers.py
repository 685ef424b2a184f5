"""Where an iteration's time goes, and how fast it runs: per-phase timers, TFLOP/s, MFU, peak memory.

Timers accumulate wall time per phase over the log interval (synchronizing the GPU at each boundary, so the numbers
are honest at a small cost, paid only when ``--timing-log-level`` > 0). At each log they are reduced to the min and max
over the ranks of the layout (TP x PP, then DP x CP: not the world, of which a layout may hold only some ranks), so
a straggler shows as a max far above the min. Throughput uses the model FLOPs
(megalite/model/flops.py, the Korthikanti et al. 2022 count generalized to this architecture), divided by the
measured time and the number of devices; MFU divides that by the device's peak (the table there).
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections import defaultdict
from typing import Optional

import torch

from megalite import parallel_state
from megalite.model.flops import peak_bf16_tflops

# Which phases each --timing-log-level reports.
LEVELS = {1: ("batch-generator", "forward-backward", "grads-reduce", "optimizer"), 2: ("pipeline-wait",)}


class Timers:
    def __init__(self, level: int, device: torch.device):
        self.level, self.device = level, device
        self.totals: dict[str, float] = defaultdict(float)

    def _enabled(self, name: str) -> bool:
        return any(name in LEVELS[k] for k in LEVELS if k <= self.level)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if not self._enabled(name):
            yield
            return
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.totals[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        if self._enabled(name):
            self.totals[name] += seconds

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def report(self, iterations: int) -> dict[str, float]:
        """``time_<phase>_ms_min/max`` per iteration over ranks (a collective when timing is on), then reset."""
        if self.level == 0:
            return {}
        names = [n for k in sorted(LEVELS) if k <= self.level for n in LEVELS[k]]
        values = torch.tensor([self.totals.get(n, 0.0) * 1000 / max(iterations, 1) for n in names],
                              dtype=torch.float64, device=self.device)
        low, high = values.clone(), values.clone()
        for info in (parallel_state.get_model_parallel_group(),
                     parallel_state.get_data_parallel_group(with_context_parallel=True)):
            info.min(low)
            info.max(high)
        self.totals.clear()
        report = {}
        for name, lo, hi in zip(names, low.tolist(), high.tolist()):
            key = name.replace("-", "_")
            report[f"time_{key}_ms_min"], report[f"time_{key}_ms_max"] = lo, hi
        return report


def peak_tflops(device: torch.device, configured: Optional[float]) -> Optional[float]:
    if configured is not None:
        return configured
    return peak_bf16_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated device memory on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30   # Linux reports KiB
