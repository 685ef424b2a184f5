"""This rank's place in the pipeline and what it runs: its stages (chunks), the schedule and its placement, the rank
holding the loss, the point-to-point links to the neighbouring stages, the schedules and transfer plans per number
of micro-batches (a batch-size ramp-up reaches several), and one global batch's run through them."""

from __future__ import annotations

import torch

from megalite import parallel_state
from megalite.config import MegaliteConfig
from megalite.config.dims import ParallelDims
from megalite.pipeline.engine import ForwardStep, ScheduleStats, StepClock, run_schedule
from megalite.pipeline.p2p import PipelineLinks
from megalite.pipeline.partition import chunks_of_rank, stage_rank
from megalite.pipeline.schedules import build_schedule, placement_of, splits_backward
from megalite.pipeline.transfers import plan_transfers
from megalite.tensor_parallel.weight_grad import WeightGradStore


class Pipeline:
    def __init__(self, cfg: MegaliteConfig, dims: ParallelDims, dtype: torch.dtype, device: torch.device):
        m = cfg.model
        self.pp, self.rank = dims.pp, parallel_state.get_pipeline_model_parallel_rank()
        self.virtual_stages = cfg.parallel.virtual_stages(m.num_layers)
        self.schedule_name = cfg.parallel.pipeline_schedule if self.pp > 1 else "1f1b"
        self.placement = placement_of(self.schedule_name)
        # The rank holding the last stage (and the loss): the last one, or the first with the v-shape placement.
        self.loss_rank = stage_rank(self.pp * self.virtual_stages - 1, self.pp, self.placement)
        split = cfg.parallel.pipeline_split(m) or m.num_layers
        self.chunks = chunks_of_rank(split, self.pp, self.virtual_stages, self.rank, self.placement)
        tokens = m.seq_length // dims.cp // (dims.tp if cfg.parallel.sequence_parallel else 1)   # its CP, SP shard
        self.links = (PipelineLinks(parallel_state.get_pipeline_model_parallel_group(),
                                    (cfg.training.micro_batch_size, tokens, m.hidden_size), dtype, device)
                      if self.pp > 1 else None)
        # Zero-bubble schedules: each B leaves the linear layers' weight gradients to its W step (the largest batch's
        # schedule says whether they do).
        largest = dims.micro_batches(cfg.training.global_batch_size, cfg.training.micro_batch_size)
        self.weight_grads = WeightGradStore() if splits_backward(self.schedules(largest)[self.rank]) else None
        self.clock = StepClock(device, measure_gpu=cfg.logging.timing_log_level > 0)
        self._plans: dict[int, tuple] = {}

    def schedules(self, num_micro_batches: int) -> list[list]:
        """Every pipeline rank's schedule for a step of ``num_micro_batches``."""
        return [build_schedule(self.pp, r, num_micro_batches, self.virtual_stages, self.schedule_name)
                for r in range(self.pp)]

    def plans(self, num_micro_batches: int) -> tuple:
        """This rank's (training, evaluation) transfer plans for a step of ``num_micro_batches`` (one per size a
        ramp-up reaches)."""
        if num_micro_batches not in self._plans:
            schedules = self.schedules(num_micro_batches)
            forward_only = [[s for s in steps if s.kind == "F"] for steps in schedules]
            self._plans[num_micro_batches] = tuple(
                plan_transfers(steps, self.pp, self.virtual_stages, self.placement)[self.rank]
                for steps in (schedules, forward_only))
        return self._plans[num_micro_batches]

    def run(self, num_micro_batches: int, forward_step: ForwardStep, forward_only: bool) -> ScheduleStats:
        """One global batch of ``num_micro_batches`` through this rank's schedule (forward steps only, outputs not
        kept, when ``forward_only``)."""
        train_plan, eval_plan = self.plans(num_micro_batches)
        return run_schedule(eval_plan if forward_only else train_plan, forward_step, self.links,
                            forward_only=forward_only, weight_grads=self.weight_grads, clock=self.clock)
