"""Memory housekeeping between iterations: Megatron's --manual-gc and --empty-unused-memory-level.

- ``--manual-gc``: Python's cyclic garbage collector runs when allocation counts say so, at a different moment on
  every rank; a pause of one rank then stalls the others in the next collective. With the option the automatic
  collector is off for the run and every rank collects at the same iterations (every ``--manual-gc-interval``, around
  each evaluation, at the end), as Megatron does.
- ``--empty-unused-memory-level`` 1 hands the CUDA caching allocator's unused blocks back after each optimizer step,
  2 also after each forward-backward (less fragmentation for other processes, some speed lost); nothing on a CPU.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from megalite.config import TrainingConfig


class MemoryHousekeeping:
    def __init__(self, cfg: TrainingConfig, device: torch.device):
        self.manual_gc, self.interval = cfg.manual_gc, cfg.manual_gc_interval
        self.empty_level = cfg.empty_unused_memory_level if device.type == "cuda" else 0
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.manual_gc:
            gc.disable()
            gc.collect()

    def collect_if_due(self, iteration: int) -> None:
        if self.manual_gc and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def around_evaluation(self):
        if self.manual_gc:
            gc.collect()
        yield
        if self.manual_gc:
            gc.collect()

    def after_forward_backward(self) -> None:
        if self.empty_level >= 2:
            torch.cuda.empty_cache()

    def after_step(self) -> None:
        if self.empty_level >= 1:
            torch.cuda.empty_cache()

    def finish(self) -> None:
        """Collect once more and give the automatic collector back (a test or tool may go on in this process)."""
        if self.manual_gc:
            gc.collect()
            if self._was_enabled:
                gc.enable()
