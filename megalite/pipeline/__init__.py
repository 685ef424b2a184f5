"""Pipeline parallelism: layer placement, schedules (pure orderings), their transfer plans and simulated bubble,
point-to-point links, the engine, and this rank's pipeline (pipeline.py)."""

from megalite.pipeline.engine import ScheduleStats, StepClock, run_schedule
from megalite.pipeline.p2p import PipelineLinks
from megalite.pipeline.partition import Chunk, chunks_of_rank
from megalite.pipeline.pipeline import Pipeline
from megalite.pipeline.schedules import SCHEDULES, Step, build_schedule, peak_in_flight, placement_of, splits_backward
from megalite.pipeline.simulation import schedule_bubble
from megalite.pipeline.transfers import RankPlan, plan_transfers

__all__ = ["ScheduleStats", "StepClock", "run_schedule", "PipelineLinks", "Chunk", "chunks_of_rank", "Pipeline",
           "SCHEDULES", "Step", "build_schedule", "peak_in_flight", "placement_of", "splits_backward",
           "schedule_bubble", "RankPlan", "plan_transfers"]
