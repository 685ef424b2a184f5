"""The training loop: one iteration is data -> pipeline schedule of forward/backward steps over micro-batches ->
gradient reduction over DP (and the tied-embedding sum across stages) -> optimizer step (unscale, clip, AdamW,
parameter gather) -> log; every ``eval_interval`` iterations, the validation loss over ``eval_iters`` global batches
(the same validation samples each time, so evaluations are comparable).

The loss is normalized by the number of tokens in the whole global batch (global batch x sequence length), so
each rank backpropagates its share of the global mean and the DP reduction is a plain sum: the result is the same
whatever the DP size or micro-batch size, which is what the equivalence tests check.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import checkpoint, parallel_state
from megalite.config import MegaliteConfig
from megalite.data import build_datasets, micro_batch_indices
from megalite.distributed import DataParallel, DataParallelEngine, EngineUnion, FullyShardedDataParallel, is_expert
from megalite.kernels import KernelPolicy
from megalite.model import GPTModel
from megalite.model.flops import model_flops_per_iteration
from megalite.optimizer import MegaliteOptimizer, learning_rate
from megalite.optimizer.clip_grads import counts_toward_norm
from megalite.pipeline import PipelineLinks, build_schedule, chunks_of_rank, run_schedule
from megalite.tensor_parallel import TensorParallelRNG
from megalite.training.metrics import MetricsLogger
from megalite.training.moe_statistics import MoEStatistics
from megalite.training.stopping import StopRequests, check_finite
from megalite.training.timers import Timers, peak_memory_gib, peak_tflops


def _sum_over_data_parallel(value: torch.Tensor) -> torch.Tensor:
    """Sum over DP x CP: every rank holding a share of the global batch's tokens."""
    info = parallel_state.get_data_parallel_group(with_context_parallel=True)
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
        t, d = cfg.training, cfg.data
        valid_samples = d.eval_iters * t.global_batch_size if d.eval_interval > 0 else 0
        self.data = build_datasets(cfg, (t.train_iters * t.global_batch_size, valid_samples, 0))
        # The tokenizer decides the vocabulary (as in Megatron); --vocab-size only sizes mock data.
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=self.data.vocab_size))
        self.cfg, self.device = cfg, device
        seed, m = cfg.training.seed, cfg.model
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.virtual_stages = cfg.parallel.virtual_stages(m.num_layers)
        self.rng = rng = TensorParallelRNG(seed, parallel_state.get_tensor_model_parallel_rank(), self.pp_rank,
                                           device)
        kernels = KernelPolicy.from_config(cfg.kernels)   # fused CUDA kernels or torch ops, per op
        self.model = torch.nn.ModuleList(
            GPTModel(m, rng, pre_process=c.is_first, post_process=c.is_last, layer_offset=c.first_layer,
                     num_layers=c.num_layers, sequence_parallel=cfg.parallel.sequence_parallel,
                     kernels=kernels)
            for c in chunks_of_rank(m.num_layers, self.pp, self.virtual_stages, self.pp_rank)).to(device)
        for chunk in self.model:
            chunk.initialize(seed)   # in fp32, then cast: the same initial weights for every dtype and layout
        self.dtype = (torch.bfloat16 if cfg.training.bf16 else torch.float16 if cfg.training.fp16
                      else torch.float32)
        o = cfg.optimizer
        # Context-parallel ranks hold the same weights: gradients are summed over DP x CP, and the distributed
        # optimizer and ZeRO-3 shard over it.
        shared = dict(data_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
                      tensor_group=parallel_state.get_tensor_model_parallel_group(),
                      embedding_group=parallel_state.get_embedding_group(),
                      tied_params=[w for chunk in self.model for w in chunk.tied_embedding_weights()])
        # Routed experts' gradients are summed over the ranks holding the same experts (megalite.distributed.
        # expert_parallel): their own engine, or their own FSDP2 units.
        expert_data = (parallel_state.get_expert_data_parallel_group()
                       if any(is_expert(p) for p in self.model.parameters()) else None)
        self.engine: DataParallelEngine
        if o.zero_level == 3:   # FSDP2 keeps fp32 shards as main parameters and casts the gathered copies itself
            self.engine = FullyShardedDataParallel(list(self.model), **shared, compute_dtype=self.dtype,
                                                   offload_params=o.offload_params, expert_group=expert_data)
        else:
            self.model.to(self.dtype)
            engine = functools.partial(DataParallel, list(self.model), bucket_size=o.ddp_bucket_size,
                                       zero=o.zero_level, overlap_grad_reduce=o.overlap_grad_reduce,
                                       overlap_param_gather=o.overlap_param_gather)
            if expert_data is None:
                self.engine = engine(**shared)
            else:
                self.engine = EngineUnion([
                    engine(**shared, select=lambda p: not is_expert(p)),
                    engine(data_group=expert_data, tensor_group=shared["tensor_group"], select=is_expert)])
        self.tied_embedding_weights = [w for chunk in self.model for w in chunk.tied_embedding_weights()]
        self.optimizer = MegaliteOptimizer(self.engine, o, cfg.training)
        self.state = TrainState()
        dp = parallel_state.get_data_parallel_world_size()
        self.num_micro_batches = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
        self.schedule = build_schedule(self.pp, self.pp_rank, self.num_micro_batches, self.virtual_stages)
        self.links = (PipelineLinks(parallel_state.get_pipeline_model_parallel_group(),
                                    (cfg.training.micro_batch_size,   # sequence parallel: this rank's shard
                                     m.seq_length // (parallel_state.get_tensor_model_parallel_world_size()
                                                      if cfg.parallel.sequence_parallel else 1), m.hidden_size),
                                    self.dtype,
                                    device) if self.pp > 1 else None)
        is_logging_rank = not dist.is_initialized() or dist.get_rank() == 0
        self.logger = MetricsLogger(cfg.logging, is_logging_rank, cfg.training.train_iters)
        # The iteration the latest saved (or loaded) checkpoint holds, so the end of training does not save it again.
        self._checkpointed_iteration = self.load_checkpoint() if cfg.checkpoint.load else None
        self.stop_requests = StopRequests(cfg.training, device)
        self.timers = Timers(cfg.logging.timing_log_level, device)
        self.peak_tflops = peak_tflops(device, cfg.logging.peak_tflops)
        self.flops_per_iteration = model_flops_per_iteration(m, cfg.training.global_batch_size)
        self.moe = MoEStatistics(self.model, m, cfg.training.micro_batch_size, cfg.training.global_batch_size)

    def describe(self) -> str:
        """One line for the start of a run: layout, schedule, model size, data."""
        # Dense parameters are the same on every expert-parallel rank, routed experts differ: summed over EP too.
        dense, routed = (torch.tensor([float(sum(p.numel() for p in self.engine.params
                                                 if counts_toward_norm(p) and is_expert(p) == expert))])
                         for expert in (False, True))
        model_group, expert_group = (parallel_state.get_model_parallel_group(),
                                     parallel_state.get_expert_model_parallel_group())
        for value, groups in ((dense, [model_group]), (routed, [model_group, expert_group])):
            for info in groups:
                if info.size > 1:
                    dist.all_reduce(value, group=info.group)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        dp = parallel_state.get_data_parallel_world_size()
        ep = parallel_state.get_expert_model_parallel_world_size()
        m = self.cfg.model
        total, experts = float(dense + routed), float(routed)
        moe = (f" ({total - experts * (1 - m.moe_router_topk / m.num_experts):,.0f} active per token, EP={ep})"
               if experts else "")
        schedule = ("interleaved 1F1B" if self.virtual_stages > 1 else "1F1B") if self.pp > 1 else "no pipelining"
        data = "mock data" if self.data.tokenizer is None else f"vocabulary {self.data.vocab_size}"
        o = self.cfg.optimizer
        sharding = {0: "unsharded optimizer", 3: "ZeRO-3 (FSDP2)"}.get(o.zero_level, f"ZeRO-{o.zero_level}")
        offload = (", parameters and optimizer on the CPU" if o.offload_params else
                   ", optimizer on the CPU" if o.optimizer_cpu_offload else "")
        return (f"megalite: TP={tp} x PP={self.pp} x DP={dp} (V={self.virtual_stages}, {schedule}, "
                f"{self.num_micro_batches} micro-batches per step); {sharding}{offload}; "
                f"{total / 1e6:.2f}M parameters{moe}; {str(self.dtype).removeprefix('torch.')}; {data}")

    def canonical_named_parameters(self):
        """(canonical name, parameter) over this rank's chunks; see GPTModel.canonical_named_parameters."""
        for chunk in self.model:
            yield from chunk.canonical_named_parameters()

    def _micro_batches(self, dataset, consumed_samples: int) -> list[torch.Tensor]:
        t = self.cfg.training
        indices = micro_batch_indices(consumed_samples, t.micro_batch_size, self.num_micro_batches,
                                      parallel_state.get_data_parallel_rank(),
                                      parallel_state.get_data_parallel_world_size())
        return [torch.stack([dataset[i] for i in batch]).to(self.device) for batch in indices]

    def _run_global_batch(self, dataset, consumed_samples: int, forward_only: bool):
        """Forward (and backward) one global batch through the pipeline schedule.

        Returns (loss summed over this rank's tokens, token count of the whole global batch, schedule stats)."""
        micro_batches = self._micro_batches(dataset, consumed_samples)
        # Every token counts (our samples have no padding), so the global batch's token count needs no all-reduce.
        loss_masks = [torch.ones_like(b[:, 1:], dtype=torch.float32) for b in micro_batches]
        global_tokens = torch.tensor(float(self.cfg.training.global_batch_size * self.cfg.model.seq_length),
                                     device=self.device)
        loss_sums: list[torch.Tensor] = []
        loss_scale = self.optimizer.loss_scale   # 1 unless fp16

        def forward_step(chunk_index: int, micro_batch: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
            chunk, batch, mask = self.model[chunk_index], micro_batches[micro_batch], loss_masks[micro_batch]
            output = chunk(batch[:, :-1] if chunk.pre_process else input_tensor,
                           batch[:, 1:] if chunk.post_process else None)
            if not chunk.post_process:
                return output
            loss_sum = (output.float() * mask).sum()
            loss_sums.append(loss_sum.detach())
            return loss_sum * (loss_scale / global_tokens)

        steps = self.schedule if not forward_only else [s for s in self.schedule if s.kind == "F"]
        stats = run_schedule(steps, forward_step, pp=self.pp, rank=self.pp_rank,
                             virtual_stages=self.virtual_stages, links=self.links, forward_only=forward_only)
        loss_sum = torch.stack(loss_sums).sum() if loss_sums else torch.zeros((), device=self.device)
        return loss_sum, global_tokens, stats

    def train_step(self) -> dict:
        """One optimizer step over one global batch; returns the iteration's metrics."""
        self.model.train()
        self.engine.start_iteration(self.num_micro_batches)
        self.moe.start(self.optimizer.loss_scale)
        with self.timers("forward-backward"):
            loss_sum, global_tokens, stats = self._run_global_batch(self.data.train, self.state.consumed_samples,
                                                                    forward_only=False)
        self.timers.add("pipeline-wait", stats.total_s - stats.busy_s)
        with self.timers("grads-reduce"):
            self.engine.finish_grad_sync()
        moe_metrics = self.moe.finish(self.device)   # global loads and losses; expert biases updated

        iteration = self.state.iteration + 1
        lr = learning_rate(iteration, self.cfg.optimizer, self.cfg.training.train_iters)
        with self.timers("optimizer"):   # unscale, clip, AdamW, and the parameter gather unless overlapped
            step = self.optimizer.step(lr)
        # Which ranks saw a NaN/Inf (only looked for when the global norm, equal on every rank, is not finite).
        norm_bad = step["grad_norm"] is not None and not math.isfinite(step["grad_norm"])
        local_bad = not bool(torch.isfinite(loss_sum)) or (norm_bad and self.optimizer.has_nonfinite_grads())
        self.engine.zero_grad()

        # Only the last stage has the loss: sum it over DP, then share it (and each stage's schedule statistics)
        # along the pipeline so rank 0 can report it.
        loss = _sum_over_data_parallel(loss_sum) / global_tokens
        per_stage = _gather_over_pipeline(torch.stack([loss, torch.tensor(stats.bubble_fraction, device=self.device),
                                                       torch.tensor(float(stats.peak_in_flight), device=self.device)]))
        self.state.iteration = iteration
        self.state.consumed_samples += self.cfg.training.global_batch_size
        record = {"iteration": iteration, "loss": float(per_stage[-1][0]), "grad_norm": step["grad_norm"],
                  "lr": lr, "consumed_samples": self.state.consumed_samples}
        record.update(moe_metrics)
        if step["skipped"]:
            record["skipped"] = True
        if "loss_scale" in step:
            record["loss_scale"] = step["loss_scale"]
        t = self.cfg.training
        if not t.fp16 and not t.no_check_for_nan_in_loss_and_grad:   # fp16 skips such steps instead
            check_finite(iteration, record["loss"], step["grad_norm"], local_bad, self.device)
        if self.pp > 1:
            bubble = [float(stage[1]) for stage in per_stage]
            record["pipeline_bubble"] = sum(bubble) / len(bubble)   # idle / compute time, mean over stages
            record["pipeline_bubble_per_stage"] = bubble
            record["pipeline_peak_in_flight"] = [int(stage[2]) for stage in per_stage]
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_iters`` global batches (the first ones of the validation set)."""
        self.engine.finish_param_sync()
        self.model.eval()
        total, tokens = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for k in range(self.cfg.data.eval_iters):
            loss_sum, global_tokens, _ = self._run_global_batch(
                self.data.valid, k * self.cfg.training.global_batch_size, forward_only=True)
            total += loss_sum
            tokens += global_tokens
        self.model.train()
        total = _sum_over_data_parallel(total)
        return float(_gather_over_pipeline(total / tokens)[-1])

    def save_checkpoint(self, directory: str):
        """Save model, optimizer, data position and RNG states into ``directory`` (collective; megalite.checkpoint)."""
        self.engine.finish_param_sync()   # the distributed optimizer's parameter gathers must have landed
        path = checkpoint.save_checkpoint(
            directory, cfg=self.cfg, iteration=self.state.iteration, consumed_samples=self.state.consumed_samples,
            parameters=list(self.canonical_named_parameters()), optimizer=self.optimizer, rng=self.rng,
            tokenizer=self.data.tokenizer, device=self.device)
        self._checkpointed_iteration = self.state.iteration
        self.logger.print(f"saved checkpoint at iteration {self.state.iteration} to {path}")
        return path

    def load_checkpoint(self) -> int | None:
        """Resume from ``--load`` at any layout (see megalite.checkpoint.load); the iteration loaded, or None when
        there is nothing to load yet (--load equal to --save, first run)."""
        c = self.cfg.checkpoint
        self.logger.print(f"megalite: loading checkpoint from {c.load} ...")
        start = time.perf_counter()
        result = checkpoint.load_checkpoint(self.cfg, parameters=list(self.canonical_named_parameters()),
                                            optimizer=self.optimizer, rng=self.rng, device=self.device)
        if result is None:
            self.logger.print(f"no checkpoint in {c.load} yet: starting from scratch")
            return None
        self.state = TrainState(result.iteration, result.consumed_samples)
        for note in [f"loaded checkpoint {result.path} in {time.perf_counter() - start:.1f} s"] + result.notes:
            self.logger.print(note)
        return result.iteration

    def _should_evaluate(self, iteration: int) -> bool:
        d = self.cfg.data
        return (d.eval_interval > 0 and d.eval_iters > 0 and self.data.valid is not None
                and (iteration % d.eval_interval == 0 or iteration == self.cfg.training.train_iters))

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
                devices = dist.get_world_size() if dist.is_initialized() else 1
                record["tflops_per_device"] = self.flops_per_iteration / elapsed_s / devices / 1e12
                if self.peak_tflops:
                    record["mfu"] = record["tflops_per_device"] / self.peak_tflops
                record["peak_memory_gib"] = peak_memory_gib(self.device)
                record.update(self.timers.report(window_iters))
                self.logger.log(record)
                records.append(record)
                window_start, window_iters = time.perf_counter(), 0
            if self._should_evaluate(record["iteration"]):
                evaluation = {"iteration": record["iteration"], "eval_loss": self.evaluate()}
                self.logger.log(evaluation)
                records.append(evaluation)
                window_start = time.perf_counter()   # evaluation time is not training time
            c = self.cfg.checkpoint
            if c.save and c.save_interval and record["iteration"] % c.save_interval == 0:
                self.save_checkpoint(c.save)
                window_start = time.perf_counter()   # nor is saving
            reason = self.stop_requests.reason_to_stop(record["iteration"])
            if reason is not None:   # every rank agreed: save below (with --save) and stop
                self.logger.print(f"megalite: stopping after iteration {record['iteration']}: {reason}")
                break
        if self.cfg.checkpoint.save and self._checkpointed_iteration != self.state.iteration:
            self.save_checkpoint(self.cfg.checkpoint.save)
        self.engine.finish_param_sync()
        self.logger.close()
        return records
