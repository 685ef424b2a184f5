"""``--profile``: a torch.profiler trace of a few training iterations, on the ranks of ``--profile-ranks``.

Recording starts once ``--profile-step-start`` iterations are done and stops once ``--profile-step-end`` are (so the
defaults 10 and 12 record iterations 11 and 12: Megatron's range), counted from the start of training, also when a run
resumes from a checkpoint (a range already passed records nothing). The profiler is created one iteration early
and warms up over it, as torch.profiler's schedule intends, so its own start-up cost stays out of the trace.

Each rank writes ``rank<R>.iterations<A>-<B>.pt.trace.json`` (Chrome trace format) into ``--profile-dir``, else
``--tensorboard-dir``, else ``./megalite-profile``: Perfetto (ui.perfetto.dev) and chrome://tracing open the file,
TensorBoard's profiler plugin (torch-tb-profiler) reads the directory. On GPUs the recorded range is also marked with
cudaProfilerStart/Stop, so ``nsys profile --capture-range=cudaProfilerApi`` captures the same iterations, which is
what Megatron's --profile does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megalite.config import LoggingConfig

DEFAULT_DIR = "megalite-profile"


class StepProfiler:
    def __init__(self, cfg: LoggingConfig, iterations_done: int):
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.start, self.end = cfg.profile_step_start, cfg.profile_step_end
        self.enabled = cfg.profile and rank in cfg.profile_rank_list() and iterations_done < self.end
        self.rank = rank
        self.directory = Path(cfg.profile_dir or cfg.tensorboard_dir or DEFAULT_DIR)
        self.first = max(self.start, iterations_done)   # the first iteration-done count recorded from
        self._profiler: Optional[torch.profiler.profile] = None
        self._cuda_range = False
        self.path: Optional[Path] = None

    def before_step(self, iterations_done: int) -> None:
        """Called before each training step with the number of iterations done so far."""
        if not self.enabled or self._profiler is not None:
            return
        warmup = 1 if self.first > 0 and iterations_done == self.first - 1 else 0
        if iterations_done != self.first - warmup:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities, record_shapes=True, with_stack=True,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=self.end - self.first, repeat=1),
            on_trace_ready=self._write)
        self._profiler.start()
        if not warmup:
            self._start_cuda_range()

    def _start_cuda_range(self) -> None:
        if torch.cuda.is_available():   # nsys --capture-range=cudaProfilerApi records from here
            torch.cuda.profiler.start()
            self._cuda_range = True

    def after_step(self, iterations_done: int) -> None:
        """Called after each training step with the number of iterations done now."""
        if self._profiler is None:
            return
        if iterations_done == self.first and not self._cuda_range:
            self._start_cuda_range()   # the warm-up iteration is over
        self._profiler.step()
        if iterations_done >= self.end:
            self.close()

    def close(self) -> None:
        """Stop recording (the trace is written once its last iteration has run; a run stopped early writes what
        it recorded)."""
        if self._profiler is None:
            return
        if self._cuda_range:
            torch.cuda.profiler.stop()
            self._cuda_range = False
        profiler, self._profiler, self.enabled = self._profiler, None, False
        profiler.stop()

    def _write(self, profiler: torch.profiler.profile) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"rank{self.rank}.iterations{self.first + 1}-{self.end}.pt.trace.json"
        profiler.export_chrome_trace(os.fspath(self.path))
        message = f"megalite: rank {self.rank}: profile of iterations {self.first + 1}-{self.end} written to {self.path}"
        print(message, flush=True)
