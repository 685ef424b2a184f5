"""When each pipeline step ran: per-step times of the logged iterations, for timelines (``tools/plot_schedule.py``).

With ``--timing-log-level 2`` and ``--metrics-file run/metrics.jsonl``, every logged iteration adds one JSON object
to ``run/metrics.steps.jsonl`` (:func:`steps_file`): the layout, and for each pipeline rank of the pipeline holding
rank 0 its steps in the order run, each ``[kind, chunk, micro_batch, start_ms, end_ms]`` (``columns`` says so), in
milliseconds from the start of the earliest rank's schedule. The ranks' times are put on one clock by the wall-clock
time each one's schedule started (``time.time()``: one clock for the ranks of a machine, as close as the machines'
clock synchronization across nodes), and the ranks of the pipeline pass a barrier just before a recorded schedule,
so they start together. On a GPU a step's times are CUDA events recorded on the compute stream around it
(megalite.pipeline.engine.StepClock), read once after the schedule. Other iterations are not recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import LoggingConfig
from megalite.pipeline import Pipeline
from megalite.pipeline.schedules import Step

COLUMNS = ("kind", "chunk", "micro_batch", "start_ms", "end_ms")


def steps_file(metrics_file: str) -> Path:
    """Where the step times of a run with this metrics file go, beside it: ``metrics.jsonl`` -> ``metrics.steps.jsonl``.
    """
    path = Path(metrics_file)
    stem = path.name[:-len(path.suffix)] if path.suffix else path.name
    return path.with_name(f"{stem}.steps.jsonl")


def on_one_clock(schedules: Sequence[Sequence[Step]],
                 measured: Sequence[tuple[float, Sequence[Sequence[float]]]]) -> list[list[list]]:
    """Each rank's steps as ``[kind, chunk, micro_batch, start_ms, end_ms]`` from the earliest rank's start, given per
    rank (wall-clock start of its schedule, [(start, end) in seconds from it] per step)."""
    origin = min(wall_start for wall_start, _ in measured)
    ranks = []
    for steps, (wall_start, times) in zip(schedules, measured):
        offset = wall_start - origin
        ranks.append([[s.kind, s.chunk, s.micro_batch, round((offset + start) * 1000, 4),
                       round((offset + end) * 1000, 4)] for s, (start, end) in zip(steps, times)])
    return ranks


class StepTimeRecorder:
    """Records the logged iterations' step times of every rank of this rank's pipeline; rank 0 writes them."""

    def __init__(self, logging: LoggingConfig, train_iters: int, pipeline: Pipeline, num_micro_batches: int,
                 device: torch.device):
        """For steps of ``num_micro_batches`` (the largest batch's: other steps are not recorded)."""
        self.path, self.log_interval = steps_file(logging.metrics_file), logging.log_interval
        self.train_iters, self.schedules, self.device = train_iters, pipeline.schedules(num_micro_batches), device
        self.virtual_stages, self.schedule_name = pipeline.virtual_stages, pipeline.schedule_name
        self.writes = not dist.is_initialized() or dist.get_rank() == 0

    @staticmethod
    def wanted(timing_log_level: int, metrics_file: str | None) -> bool:
        return timing_log_level >= 2 and bool(metrics_file)

    def records(self, iteration: int) -> bool:
        """Whether ``iteration`` (1-based) is logged, hence recorded."""
        return iteration % self.log_interval == 0 or iteration == self.train_iters

    def align(self) -> None:
        """Start the pipeline's clocks together (a barrier over the pipeline group)."""
        group = parallel_state.get_pipeline_model_parallel_group()
        if group.size > 1:
            dist.barrier(group=group.group)

    def write(self, iteration: int, step_times: list[tuple[float, float]], wall_start: float) -> None:
        """Gather this pipeline's step times (collective over the pipeline group) and append them (rank 0).
        ``step_times`` are seconds from this rank's schedule start, which was at ``wall_start`` (time.time())."""
        group = parallel_state.get_pipeline_model_parallel_group()
        longest = max(len(steps) for steps in self.schedules)
        mine = torch.zeros(longest + 1, 2, dtype=torch.float64, device=self.device)
        mine[0, 0] = wall_start   # row 0: the anchor; then the steps
        if step_times:
            mine[1:len(step_times) + 1] = torch.tensor(step_times, dtype=torch.float64)
        parts = [mine]
        if group.size > 1:
            parts = [torch.empty_like(mine) for _ in range(group.size)]
            dist.all_gather(parts, mine, group=group.group)
        if not self.writes:
            return
        measured = [(float(part[0, 0]), part[1:].cpu().tolist()) for part in parts]
        ranks = on_one_clock(self.schedules, measured)
        record = {"iteration": iteration, "schedule": self.schedule_name, "pipeline_model_parallel_size": group.size,
                  "virtual_stages": self.virtual_stages,
                  "num_micro_batches": len({s.micro_batch for s in self.schedules[0]}),
                  "columns": list(COLUMNS), "ranks": ranks}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
