"""The training loop: one iteration is data -> forward/backward over micro-batches -> DP gradient sum -> clip ->
AdamW step -> log.

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
from megalite.distributed import all_reduce_gradients
from megalite.model import GPTModel
from megalite.optimizer import build_optimizer, clip_grad_norm_, learning_rate
from megalite.pipeline import get_forward_backward_func
from megalite.tensor_parallel import TensorParallelRNG
from megalite.training.metrics import MetricsLogger


def _sum_over_data_parallel(value: torch.Tensor) -> torch.Tensor:
    info = parallel_state.get_data_parallel_group()
    if info.size > 1:
        dist.all_reduce(value, group=info.group)
    return value


@dataclass
class TrainState:
    iteration: int = 0            # optimizer steps taken
    consumed_samples: int = 0


class Trainer:
    """Builds the model, optimizer and data for the registered layout, then runs iterations."""

    def __init__(self, cfg: MegaliteConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        seed = cfg.training.seed
        rng = TensorParallelRNG(seed, parallel_state.get_tensor_model_parallel_rank(),
                                parallel_state.get_pipeline_model_parallel_rank(), device)
        self.model = GPTModel(cfg.model, rng).to(device)
        self.model.initialize(seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.dataset = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, seed)
        self.forward_backward = get_forward_backward_func(cfg.parallel.pipeline_model_parallel_size)
        self.state = TrainState()
        dp = parallel_state.get_data_parallel_world_size()
        self.num_micro_batches = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
        is_logging_rank = not dist.is_initialized() or dist.get_rank() == 0
        self.logger = MetricsLogger(cfg.logging, is_logging_rank, cfg.training.train_iters)

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

        def forward_step(batch_and_mask):
            batch, mask = batch_and_mask
            with self._autocast():
                losses = self.model(batch[:, :-1], batch[:, 1:])
            loss_sum = (losses.float() * mask).sum()
            return loss_sum / global_tokens, loss_sum.detach()

        reports = self.forward_backward(forward_step, list(zip(micro_batches, loss_masks)))
        all_reduce_gradients(self.params)

        iteration = self.state.iteration + 1
        lr = learning_rate(iteration, self.cfg.optimizer, self.cfg.training.train_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = clip_grad_norm_(self.params, self.cfg.optimizer.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        loss = _sum_over_data_parallel(torch.stack(reports).sum()) / global_tokens
        self.state.iteration = iteration
        self.state.consumed_samples += self.cfg.training.global_batch_size
        return {"iteration": iteration, "loss": float(loss), "grad_norm": grad_norm, "lr": lr,
                "consumed_samples": self.state.consumed_samples}

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
