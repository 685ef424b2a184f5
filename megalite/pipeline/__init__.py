"""Pipeline parallelism: layer partition, schedules (pure orderings), point-to-point links and the engine."""

from megalite.pipeline.engine import ScheduleStats, run_schedule
from megalite.pipeline.p2p import PipelineLinks
from megalite.pipeline.partition import Chunk, chunks_of_rank
from megalite.pipeline.schedules import Step, build_schedule, peak_in_flight

__all__ = ["ScheduleStats", "run_schedule", "PipelineLinks", "Chunk", "chunks_of_rank", "Step", "build_schedule",
           "peak_in_flight"]
