"""The training loop: one iteration is data -> pipeline schedule of forward/backward steps over micro-batches ->
DP gradient sum (and tied-embedding sum across stages) -> clip -> AdamW step -> log.

The loss is normalized by the number of tokens in the whole global batch (counted across DP before backward), so
each rank backpropagates its share of the global mean and the DP reduction is a plain sum: the result is the same
whatever the DP size or micro-batch size, which is what the equivalence tests check.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import MegaliteConfig
from megalite.data import MockGPTDataset, micro_batch_indices
from megalite.distributed import all_reduce_gradients, all_reduce_tied_embedding_gradients
from megalite.model import GPTModel
from megalite.optimizer import build_optimizer, clip_grad_norm_, learning_rate
from megalite.pipeline import PipelineLinks, build_schedule, chunks_of_rank, run_schedule
from megalite.tensor_parallel import TensorParallelRNG
from megalite.training.metrics import MetricsLogger


def _sum_over_data_parallel(value: torch.Tensor) -> torch.Tensor:
    info = parallel_state.get_data_parallel_group()
    if info.size > 1:
        dist.all_reduce(value, group=info.group)
    return value


def _gather_over_pipeline(value: torch.Tensor) -> list[torch.Tensor]:
    info = parallel_state.get_pipeline_model_parallel_group()
    if info.size == 1:
        return [value]
    parts = [torch.empty_like(value) for _ in range(info.size)]
    dist.all_gather(parts, value, group=info.group)
    return parts


@dataclass
class TrainState:
    iteration: int = 0            # optimizer steps taken
    consumed_samples: int = 0


class Trainer:
    """Builds this rank's model chunks, optimizer and data for the registered layout, then runs iterations."""

    def __init__(self, cfg: MegaliteConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        seed, m = cfg.training.seed, cfg.model
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.virtual_stages = cfg.parallel.virtual_stages(m.num_layers)
        rng = TensorParallelRNG(seed, parallel_state.get_tensor_model_parallel_rank(), self.pp_rank, device)
        self.model = torch.nn.ModuleList(
            GPTModel(m, rng, pre_process=c.is_first, post_process=c.is_last, layer_offset=c.first_layer,
                     num_layers=c.num_layers)
            for c in chunks_of_rank(m.num_layers, self.pp, self.virtual_stages, self.pp_rank)).to(device)
        for chunk in self.model:
            chunk.initialize(seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.tied_embedding_weights = [w for chunk in self.model for w in chunk.tied_embedding_weights()]
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.dataset = MockGPTDataset(m.vocab_size, m.seq_length, seed)
        self.state = TrainState()
        dp = parallel_state.get_data_parallel_world_size()
        self.num_micro_batches = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
        self.schedule = build_schedule(self.pp, self.pp_rank, self.num_micro_batches, self.virtual_stages)
        # Activations travel in fp32: the residual stream stays fp32 under bf16 autocast.
        self.links = (PipelineLinks(parallel_state.get_pipeline_model_parallel_group(),
                                    (cfg.training.micro_batch_size, m.seq_length, m.hidden_size), torch.float32,
                                    device) if self.pp > 1 else None)
        is_logging_rank = not dist.is_initialized() or dist.get_rank() == 0
        self.logger = MetricsLogger(cfg.logging, is_logging_rank, cfg.training.train_iters)

    def canonical_named_parameters(self):
        """(canonical name, parameter) over this rank's chunks; see GPTModel.canonical_named_parameters."""
        for chunk in self.model:
            yield from chunk.canonical_named_parameters()

    def _micro_batches(self) -> list[torch.Tensor]:
        t = self.cfg.training
        indices = micro_batch_indices(self.state.consumed_samples, t.micro_batch_size, self.num_micro_batches,
                                      parallel_state.get_data_parallel_rank(),
                                      parallel_state.get_data_parallel_world_size())
        return [torch.stack([self.dataset[i] for i in batch]).to(self.device) for batch in indices]

    def _autocast(self):
        if self.cfg.training.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> dict:
        """One optimizer step over one global batch; returns the iteration's metrics."""
        self.model.train()
        micro_batches = self._micro_batches()
        # Every token counts (mock data has no padding); the count is summed over DP for the global mean.
        loss_masks = [torch.ones_like(b[:, 1:], dtype=torch.float32) for b in micro_batches]
        global_tokens = _sum_over_data_parallel(torch.stack([m.sum() for m in loss_masks]).sum())
        loss_sums: list[torch.Tensor] = []

        def forward_step(chunk_index: int, micro_batch: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
            chunk, batch, mask = self.model[chunk_index], micro_batches[micro_batch], loss_masks[micro_batch]
            with self._autocast():
                output = chunk(batch[:, :-1] if chunk.pre_process else input_tensor,
                               batch[:, 1:] if chunk.post_process else None)
            if not chunk.post_process:
                return output
            loss_sum = (output.float() * mask).sum()
            loss_sums.append(loss_sum.detach())
            return loss_sum / global_tokens

        stats = run_schedule(self.schedule, forward_step, pp=self.pp, rank=self.pp_rank,
                             virtual_stages=self.virtual_stages, links=self.links)
        all_reduce_gradients(self.params)
        all_reduce_tied_embedding_gradients(self.tied_embedding_weights)

        iteration = self.state.iteration + 1
        lr = learning_rate(iteration, self.cfg.optimizer, self.cfg.training.train_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = clip_grad_norm_(self.params, self.cfg.optimizer.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        # Only the last stage has the loss: sum it over DP, then share it (and each stage's schedule statistics)
        # along the pipeline so rank 0 can report it.
        loss_sum = torch.stack(loss_sums).sum() if loss_sums else torch.zeros((), device=self.device)
        loss = _sum_over_data_parallel(loss_sum) / global_tokens
        per_stage = _gather_over_pipeline(torch.stack([loss, torch.tensor(stats.idle_fraction, device=self.device),
                                                       torch.tensor(float(stats.peak_in_flight), device=self.device)]))
        self.state.iteration = iteration
        self.state.consumed_samples += self.cfg.training.global_batch_size
        record = {"iteration": iteration, "loss": float(per_stage[-1][0]), "grad_norm": grad_norm, "lr": lr,
                  "consumed_samples": self.state.consumed_samples}
        if self.pp > 1:
            idle = [float(stage[1]) for stage in per_stage]
            record["pipeline_bubble"] = sum(idle) / len(idle)
            record["pipeline_idle_per_stage"] = idle
            record["pipeline_peak_in_flight"] = [int(stage[2]) for stage in per_stage]
        return record

    def train(self) -> list[dict]:
        """Run to ``train_iters``; return the logged records (every rank computes them, rank 0 writes them)."""
        t, interval = self.cfg.training, self.cfg.logging.log_interval
        records, window_start, window_iters = [], time.perf_counter(), 0
        while self.state.iteration < t.train_iters:
            record = self.train_step()
            window_iters += 1
            if record["iteration"] % interval == 0 or record["iteration"] == t.train_iters:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed_s = (time.perf_counter() - window_start) / window_iters
                record["elapsed_ms"] = elapsed_s * 1000.0
                record["tokens_per_sec"] = t.global_batch_size * self.cfg.model.seq_length / elapsed_s
                self.logger.log(record)
                records.append(record)
                window_start, window_iters = time.perf_counter(), 0
        self.logger.close()
        return records
