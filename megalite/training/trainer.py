"""The training loop: one iteration is data -> pipeline schedule of forward/backward steps over micro-batches ->
gradient reduction over DP (and the tied-embedding sum across stages) -> optimizer step (unscale, clip, AdamW,
parameter gather) -> log; every ``eval_interval`` iterations, the validation loss over ``eval_iters`` global batches
(the same validation samples each time, so evaluations are comparable).

The loss is normalized by the number of tokens in the whole global batch (global batch x sequence length, or the
tokens left by ``--eod-mask-loss``, counted over every rank), so each rank backpropagates its share of the global
mean and the DP reduction is a plain sum: the result is the same whatever the DP size or micro-batch size, which is
what the equivalence tests check. Under context parallelism each rank holds some tokens of every sample of its DP
rank's micro-batches (megalite.model.context_parallel); their loss sums over DP x CP like the DP ranks' do.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megalite import checkpoint, parallel_state
from megalite.config import MegaliteConfig
from megalite.config.batches import batch_schedule, describe as describe_batches, train_iterations
from megalite.data import build_datasets, micro_batch_indices
from megalite.data.packing import packed_documents
from megalite.distributed import DataParallel, DataParallelEngine, EngineUnion, FullyShardedDataParallel, is_expert
from megalite.kernels import KernelPolicy, prepare
from megalite.model import GPTModel
from megalite.model.context_parallel import SequenceShard, shard_sequence
from megalite.model.flops import model_flops_per_iteration
from megalite.run import Run
from megalite.optimizer import LRSchedule, MegaliteOptimizer
from megalite.optimizer.clip_grads import counts_toward_norm
from megalite.pipeline import (PipelineLinks, StepClock, build_schedule, chunks_of_rank, placement_of, plan_transfers,
                               run_schedule, splits_backward)
from megalite.pipeline.partition import stage_rank
from megalite.tensor_parallel import (Fp8Recipe, TensorParallelRNG, WeightGradStore, attach_weight_grad_store,
                                      update_delayed_scales)
from megalite.tensor_parallel.fp8 import has_fp8_tensor_cores
from megalite.training.housekeeping import MemoryHousekeeping
from megalite.training.metrics import MetricsLogger
from megalite.training.moe_statistics import MoEStatistics
from megalite.training.profiling import StepProfiler
from megalite.training.step_times import StepTimeRecorder
from megalite.training.stopping import StopRequests, check_finite, check_loss_scale
from megalite.training.prefetch import BatchPrefetcher
from megalite.training.timers import Timers, peak_memory_gib, peak_tflops


def _sum_over_data_parallel(value: torch.Tensor) -> torch.Tensor:
    """Sum over DP x CP: every rank holding a share of the global batch's tokens."""
    info = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if info.size > 1:
        dist.all_reduce(value, group=info.group)
    return value


def _start_sum_over_data_parallel(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The same sum, launched now: returns a function that waits for it (once) and gives ``value``."""
    info = parallel_state.get_data_parallel_group(with_context_parallel=True)
    work = [dist.all_reduce(value, group=info.group, async_op=True)] if info.size > 1 else []

    def result() -> torch.Tensor:
        while work:
            work.pop().wait()
        return value
    return result


def _gather_over_pipeline(value: torch.Tensor) -> list[torch.Tensor]:
    info = parallel_state.get_pipeline_model_parallel_group()
    if info.size == 1:
        return [value]
    parts = [torch.empty_like(value) for _ in range(info.size)]
    dist.all_gather(parts, value, group=info.group)
    return parts


def parameter_counts(params, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model's (dense, routed expert) parameter counts from this rank's ``params`` (collective over the
    model-parallel and expert groups). Dense parameters are the same on every expert-parallel rank, routed experts
    differ: summed over EP too. Summed on ``device``, the compute device: an NCCL group carries CUDA tensors only."""
    dense, routed = (torch.tensor([float(sum(p.numel() for p in params if counts_toward_norm(p)
                                             and is_expert(p) == expert))], device=device)
                     for expert in (False, True))
    model_group, expert_group = (parallel_state.get_model_parallel_group(),
                                 parallel_state.get_expert_model_parallel_group())
    for value, groups in ((dense, [model_group]), (routed, [model_group, expert_group])):
        for info in groups:
            if info.size > 1:
                dist.all_reduce(value, group=info.group)
    return dense, routed


@dataclass
class MicroBatch:
    """What one micro-batch feeds this rank: its tokens of the samples (all of them without context parallelism),
    the next tokens as labels, which of them count in the loss, and where they sit in the samples."""
    inputs: torch.Tensor      # [micro-batch, local tokens]
    labels: torch.Tensor      # [micro-batch, local tokens]
    loss_mask: torch.Tensor   # [micro-batch, local tokens], fp32
    shard: SequenceShard

    @classmethod
    def of(cls, samples: torch.Tensor, cfg: MegaliteConfig, eod: int | None) -> "MicroBatch":
        """From samples of seq length + 1 tokens [micro-batch, seq + 1]; ``eod`` ends the packed documents."""
        inputs, labels = samples[:, :-1], samples[:, 1:]
        d = cfg.data
        packing = (packed_documents(inputs, eod, reset_position_ids=d.reset_position_ids,
                                    reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss)
                   if eod is not None else None)
        shard = shard_sequence(inputs.shape[1], samples.device, comm_type=cfg.parallel.cp_comm_type,
                               positions=packing.positions if packing else None,
                               documents=packing.documents if packing else None)
        loss_mask = packing.loss_mask if packing is not None else torch.ones_like(labels, dtype=torch.float32)
        return cls(shard.take(inputs), shard.take(labels), shard.take(loss_mask), shard)


@dataclass
class TrainState:
    iteration: int = 0            # optimizer steps taken
    consumed_samples: int = 0


class Trainer:
    """Builds this rank's model chunks, optimizer and data for the registered layout, then runs iterations."""

    def __init__(self, run: Run, device: torch.device):
        cfg = run.cfg
        t, d = cfg.training, cfg.data
        # The global batch of each iteration (constant, or ramping up with the consumed samples) and the run's length.
        self.batches = batch_schedule(t, cfg.model.seq_length)
        self.train_iters = train_iterations(t, self.batches)
        valid_samples = d.eval_iters * t.global_batch_size if d.eval_interval > 0 else 0
        self.data = build_datasets(cfg, (self.batches.consumed_after(self.train_iters), valid_samples, 0),
                                   run.tokenizer)
        self.cfg, self.device = cfg, device
        seed, m = cfg.training.seed, cfg.model
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.virtual_stages = cfg.parallel.virtual_stages(m.num_layers)
        self.schedule_name = cfg.parallel.pipeline_schedule if self.pp > 1 else "1f1b"
        self.placement = placement_of(self.schedule_name)
        # The rank holding the last stage (and the loss): the last one, or the first with the v-shape placement.
        self.loss_rank = stage_rank(self.pp * self.virtual_stages - 1, self.pp, self.placement)
        self.rng = rng = TensorParallelRNG(seed, parallel_state.get_tensor_model_parallel_rank(), self.pp_rank,
                                           device, parallel_state.get_context_parallel_rank())
        # Fused CUDA kernels or torch ops, per op: built, self-checked and agreed over every rank now, before any step.
        kernels = prepare(KernelPolicy.from_config(cfg.kernels), device, 60 * cfg.training.distributed_timeout_minutes)
        # Simulated GPUs (megalite.simulation) build the chunks on their meta device directly: no host memory.
        with torch.device(device) if device.type == "meta" else contextlib.nullcontext():
            self.model = torch.nn.ModuleList(
                GPTModel(m, rng, pre_process=c.is_first, post_process=c.is_last, layer_offset=c.first_layer,
                         num_layers=c.num_layers, sequence_parallel=cfg.parallel.sequence_parallel,
                         kernels=kernels)
                for c in chunks_of_rank(m.num_layers, self.pp, self.virtual_stages, self.pp_rank, self.placement)
            ).to(device)
        for chunk in self.model:
            chunk.initialize(seed)   # in fp32, then cast: the same initial weights for every dtype and layout
        self.dtype = (torch.bfloat16 if cfg.training.bf16 else torch.float16 if cfg.training.fp16
                      else torch.float32)
        o = cfg.optimizer
        # Context-parallel ranks hold the same weights: gradients are summed over DP x CP, and the distributed
        # optimizer and ZeRO-3 shard over it. With the first and last stage on one rank (v-shape) both embedding
        # copies are here: summed locally.
        shared = dict(data_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
                      tensor_group=parallel_state.get_tensor_model_parallel_group(),
                      embedding_group=parallel_state.get_embedding_group() if self.loss_rank != 0 else None,
                      tied_params=[w for chunk in self.model for w in chunk.tied_embedding_weights()])
        # Routed experts' gradients are summed over the ranks holding the same experts (megalite.distributed.
        # expert_parallel): their own engine, or their own FSDP2 units.
        expert_data = (parallel_state.get_expert_data_parallel_group()
                       if any(is_expert(p) for p in self.model.parameters()) else None)
        self.engine: DataParallelEngine
        grad_dtype = torch.bfloat16 if o.grad_reduce_in_bf16 else torch.float32
        if o.zero_level == 3:   # FSDP2 keeps fp32 shards as main parameters and casts the gathered copies itself
            self.engine = FullyShardedDataParallel(list(self.model), **shared, compute_dtype=self.dtype,
                                                   offload_params=o.offload_params,
                                                   prefetch_bucket_size=o.zero3_prefetch_bucket_size,
                                                   grad_dtype=grad_dtype, expert_group=expert_data,
                                                   fp8_param_gather=m.fp8_param_gather)
        else:
            self.model.to(self.dtype)
            engine = functools.partial(DataParallel, list(self.model), bucket_size=o.ddp_bucket_size,
                                       zero=o.zero_level, grad_dtype=grad_dtype,
                                       overlap_grad_reduce=o.overlap_grad_reduce,
                                       overlap_param_gather=o.overlap_param_gather,
                                       gradient_accumulation_fusion=not o.no_gradient_accumulation_fusion,
                                       fp8_param_gather=m.fp8_param_gather)
            if expert_data is None:
                self.engine = engine(**shared)
            else:
                self.engine = EngineUnion([
                    engine(**shared, select=lambda p: not is_expert(p)),
                    engine(data_group=expert_data, tensor_group=shared["tensor_group"], select=is_expert)])
        self.tied_embedding_weights = [w for chunk in self.model for w in chunk.tied_embedding_weights()]
        # The FP8 linears' amax histories (delayed recipe), by canonical name (checkpoints keep them).
        self.fp8_histories = [found for chunk in self.model for found in chunk.canonical_fp8_histories()]
        self.fp8_groups = (parallel_state.get_tensor_model_parallel_group(),
                           parallel_state.get_data_parallel_group(with_context_parallel=True))
        self.optimizer = MegaliteOptimizer(self.engine, o, cfg.training)
        self.lr_schedule = LRSchedule.from_config(o, cfg.training, m.seq_length)
        self.state = TrainState()
        # Micro-batches per step at the largest (evaluation's) global batch; a ramp-up runs fewer while it grows.
        self.num_micro_batches = self.micro_batches_in(cfg.training.global_batch_size)
        self._plans: dict[int, tuple] = {}
        self.cp = parallel_state.get_context_parallel_world_size()
        # Zero-bubble schedules: each B leaves the linear layers' weight gradients to its W step.
        largest = self.schedules(self.num_micro_batches)   # every rank's, at the largest batch
        self.weight_grads = WeightGradStore() if splits_backward(largest[self.pp_rank]) else None
        attach_weight_grad_store(self.model, self.weight_grads)
        self.clock = StepClock(device, measure_gpu=cfg.logging.timing_log_level > 0)
        lg = cfg.logging   # --timing-log-level 2: the logged iterations' step times, for timelines
        self.step_times = (StepTimeRecorder(
            lg.metrics_file, lg.log_interval, self.train_iters, largest,
            self.virtual_stages, device, self.schedule_name)
            if StepTimeRecorder.wanted(lg.timing_log_level, lg.metrics_file) else None)
        self.links = (PipelineLinks(parallel_state.get_pipeline_model_parallel_group(),
                                    (cfg.training.micro_batch_size,   # this rank's tokens: its CP and SP shard
                                     m.seq_length // self.cp // (parallel_state.get_tensor_model_parallel_world_size()
                                                                 if cfg.parallel.sequence_parallel else 1),
                                     m.hidden_size),
                                    self.dtype,
                                    device) if self.pp > 1 else None)
        is_logging_rank = not dist.is_initialized() or dist.get_rank() == 0
        self.logger = MetricsLogger(cfg.logging, is_logging_rank, self.train_iters, cfg)
        # The iteration the latest saved (or loaded) checkpoint holds, so the end of training does not save it again.
        self._checkpointed_iteration = self.load_checkpoint() if cfg.checkpoint.load else None
        self._pending_save: checkpoint.PendingSave | None = None   # an --async-save still being written
        self.stop_requests = StopRequests(cfg.training, device)
        self.timers = Timers(cfg.logging.timing_log_level, device)
        self.prefetcher = BatchPrefetcher(lambda consumed, n: self._samples(self.data.train, consumed, n),
                                          enabled=not cfg.data.no_data_prefetch)
        self.memory = MemoryHousekeeping(cfg.training, device)
        self.peak_tflops = peak_tflops(device, cfg.logging.peak_tflops)
        self.flops_per_sample = model_flops_per_iteration(m, 1)
        self.moe = MoEStatistics(self.model, m, cfg.training.micro_batch_size)

    @classmethod
    def on_registered_layout(cls, cfg: MegaliteConfig, device: torch.device) -> "Trainer":
        """The trainer of ``cfg`` as it is, at the size of the layout already registered (tools, benchmarks and
        tests that build their own groups; pretrain_gpt resolves and checks the run from the world first)."""
        return cls(Run.of(cfg, parallel_state.layout_size()), device)

    def describe(self) -> str:
        """One line for the start of a run: layout, schedule, model size, data."""
        dense, routed = parameter_counts(self.engine.params, self.device)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        dp = parallel_state.get_data_parallel_world_size()
        ep = parallel_state.get_expert_model_parallel_world_size()
        m = self.cfg.model
        total, experts = float(dense + routed), float(routed)
        moe = (f" ({total - experts * (1 - m.moe_router_topk / m.num_experts):,.0f} active per token, EP={ep})"
               if m.num_experts else "")
        schedule = {"1f1b": "1F1B", "zero-bubble": "ZB-H1", "zbv": "ZB-V"}[self.schedule_name]
        if self.pp == 1:
            schedule = "no pipelining"
        elif self.virtual_stages > 1 and self.schedule_name != "zbv":
            schedule = f"interleaved {schedule}"
        data = "mock data" if self.data.tokenizer is None else f"vocabulary {self.data.vocab_size}"
        o = self.cfg.optimizer
        sharding = {0: "unsharded optimizer", 3: "ZeRO-3 (FSDP2)"}.get(o.zero_level, f"ZeRO-{o.zero_level}")
        offload = (", parameters and optimizer on the CPU" if o.offload_params else
                   ", optimizer on the CPU" if o.optimizer_cpu_offload else "")
        micro = (f"{self.micro_batches_in(self.batches.smallest)}-{self.num_micro_batches}" if self.batches.ramps
                 else f"{self.num_micro_batches}")
        context = f"CP={self.cp} ({self.cfg.parallel.cp_comm_type}) x " if self.cp > 1 else ""
        return (f"megalite: TP={tp} x {context}PP={self.pp} x DP={dp} (V={self.virtual_stages}, {schedule}, "
                f"{micro} micro-batches per step, {describe_batches(self.batches)}); {sharding}{offload}; "
                f"{total / 1e6:.2f}M parameters{moe}; {str(self.dtype).removeprefix('torch.')}{self._fp8_words()}; "
                f"{data}")

    def _fp8_words(self) -> str:
        """What --fp8-format adds to the start-up line: the recipe, and on a device without FP8 tensor cores that
        it will not be faster."""
        recipe = Fp8Recipe.of(self.cfg.model)
        if recipe is None:
            return ""
        words = f" with {recipe.describe()} in the attention and MLP linears"
        if self.cfg.model.fp8_param_gather:
            words += ", their weights all-gathered in FP8"
        if not has_fp8_tensor_cores(self.device):
            words += (f" (no FP8 tensor cores on {self.device.type}: correct, but not faster than bf16; torch's "
                      f"scaled matrix product or its dequantized fallback does the products)")
        return words

    def canonical_named_parameters(self):
        """(canonical name, parameter) over this rank's chunks; see GPTModel.canonical_named_parameters."""
        for chunk in self.model:
            yield from chunk.canonical_named_parameters()

    def micro_batches_in(self, global_batch_size: int) -> int:
        """Micro-batches each DP rank runs for one global batch of ``global_batch_size`` samples."""
        return global_batch_size // (self.cfg.training.micro_batch_size * parallel_state.get_data_parallel_world_size())

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
                plan_transfers(steps, self.pp, self.virtual_stages, self.placement)[self.pp_rank]
                for steps in (schedules, forward_only))
        return self._plans[num_micro_batches]

    def _samples(self, dataset, consumed_samples: int, num_micro_batches: int) -> list[torch.Tensor]:
        """This DP rank's samples of the global batch, one [micro-batch, seq + 1] tensor per micro-batch, on the host
        (in pinned memory on a GPU, for an asynchronous copy); run by the prefetch thread for training batches."""
        t = self.cfg.training
        indices = micro_batch_indices(consumed_samples, t.micro_batch_size, num_micro_batches,
                                      parallel_state.get_data_parallel_rank(),
                                      parallel_state.get_data_parallel_world_size())
        stacked = [torch.stack([dataset[i] for i in batch]) for batch in indices]
        return [s.pin_memory() for s in stacked] if self.device.type == "cuda" else stacked

    def _micro_batches(self, samples: list[torch.Tensor]) -> list[MicroBatch]:
        """This rank's micro-batches of the global batch: its DP rank's samples, its CP rank's tokens of them."""
        d = self.cfg.data
        packing = d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss
        eod = self.data.tokenizer.eod if packing else None   # validation refused packing without a tokenizer
        cuda = self.device.type == "cuda"
        return [MicroBatch.of(s.to(self.device, non_blocking=cuda), self.cfg, eod) for s in samples]

    def _run_global_batch(self, dataset, consumed_samples: int, forward_only: bool,
                          global_batch_size: int | None = None, record_steps: bool = False,
                          samples: list[torch.Tensor] | None = None):
        """Forward (and backward) one global batch (of ``global_batch_size`` samples, default the largest) through
        the pipeline schedule (``record_steps``: with its steps' times, clocks aligned over the pipeline); its
        ``samples`` (from :meth:`_samples`) are read here unless given.

        Returns (loss summed over this rank's tokens, token count of the whole global batch, schedule stats)."""
        global_batch_size = global_batch_size or self.cfg.training.global_batch_size
        num_micro_batches = self.micro_batches_in(global_batch_size)
        if samples is None:
            samples = self._samples(dataset, consumed_samples, num_micro_batches)
        micro_batches = self._micro_batches(samples)
        if self.cfg.data.eod_mask_loss:   # the tokens that count, over every rank's share of the global batch
            # Waited for only where the first loss is scaled by it: overlapped parameter gathers still in flight on
            # this group come before it, and the first forward need not wait for them all.
            counting = _start_sum_over_data_parallel(torch.stack([b.loss_mask.sum() for b in micro_batches]).sum())
            global_tokens_now = lambda: counting().clamp(min=1.0)   # noqa: E731
        else:   # every token counts (our samples have no padding): the count needs no all-reduce
            tokens = torch.tensor(float(global_batch_size * self.cfg.model.seq_length), device=self.device)
            global_tokens_now = lambda: tokens   # noqa: E731
        loss_sums: list[torch.Tensor] = []
        loss_scale = self.optimizer.loss_scale   # 1 unless fp16

        def forward_step(chunk_index: int, micro_batch: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
            chunk, batch = self.model[chunk_index], micro_batches[micro_batch]
            mask = batch.loss_mask
            output = chunk(batch.inputs if chunk.pre_process else input_tensor,
                           batch.labels if chunk.post_process else None, batch.shard)
            if not chunk.post_process:
                return output
            loss_sum = (output.float() * mask).sum()
            loss_sums.append(loss_sum.detach())
            return loss_sum * (loss_scale / global_tokens_now())

        train_plan, eval_plan = self.plans(num_micro_batches)
        if record_steps:
            self.step_times.align()
        stats = run_schedule(eval_plan if forward_only else train_plan, forward_step, self.links,
                             forward_only=forward_only, weight_grads=self.weight_grads, clock=self.clock)
        loss_sum = torch.stack(loss_sums).sum() if loss_sums else torch.zeros((), device=self.device)
        return loss_sum, global_tokens_now(), stats

    def train_step(self) -> dict:
        """One optimizer step over one global batch; returns the iteration's metrics."""
        self.model.train()
        consumed = self.state.consumed_samples
        batch = self.batches.at(consumed)
        with self.timers("batch-generator"):   # ~0 once warm: the batch was assembled during the last step
            samples = self.prefetcher.get(consumed, self.micro_batches_in(batch))
        if self.state.iteration + 1 < self.train_iters:
            following = self.batches.at(consumed + batch)
            self.prefetcher.ahead(consumed + batch, self.micro_batches_in(following))
        self.engine.start_iteration(self.micro_batches_in(batch))
        self.moe.start(self.optimizer.loss_scale, batch)
        # Step times are recorded at the largest batch only: the recorder's schedules are those of that batch.
        record_steps = (self.step_times is not None and batch == self.cfg.training.global_batch_size
                        and self.step_times.records(self.state.iteration + 1))
        with self.timers("forward-backward"):
            loss_sum, global_tokens, stats = self._run_global_batch(self.data.train, consumed, forward_only=False,
                                                                    global_batch_size=batch,
                                                                    record_steps=record_steps, samples=samples)
        self.memory.after_forward_backward()
        if record_steps:
            self.step_times.write(self.state.iteration + 1, stats.step_times, stats.wall_start)
        if stats.busy_s is not None:
            self.timers.add("pipeline-wait", stats.total_s - stats.busy_s)
        with self.timers("grads-reduce"):
            self.engine.finish_grad_sync()
        moe_metrics = self.moe.finish(self.device)   # global loads and losses; expert biases updated
        # Only the last stage has the loss: sum it over DP before the optimizer step launches the parameter
        # gathers (overlapped ones would otherwise queue this all-reduce, on the same group, behind every one of
        # them, and the next forward behind it).
        local_bad = not bool(torch.isfinite(loss_sum))
        loss = _sum_over_data_parallel(loss_sum.clone()) / global_tokens

        iteration = self.state.iteration + 1
        o, consumed = self.cfg.optimizer, self.state.consumed_samples + batch
        lr = self.lr_schedule.at(consumed, o.lr, o.min_lr)
        decoupled_lr = (None if o.decoupled_lr is None else
                        self.lr_schedule.at(consumed, o.decoupled_lr, o.min_lr if o.decoupled_min_lr is None
                                            else o.decoupled_min_lr))
        # FP8 delayed scaling: this step's amaxes, maxed over the ranks holding each layer, give the next scales
        # (before the optimizer step, whose FP8 parameter gather quantizes the weights with them).
        update_delayed_scales(self.fp8_histories, self.fp8_groups)
        with self.timers("optimizer"):   # unscale, clip, AdamW, and the parameter gather unless overlapped
            step = self.optimizer.step(lr, decoupled_lr)
        self.memory.after_step()
        # Which ranks saw a NaN/Inf (only looked for when the global norm, equal on every rank, is not finite).
        norm_bad = step["grad_norm"] is not None and not math.isfinite(step["grad_norm"])
        local_bad = local_bad or (norm_bad and self.optimizer.has_nonfinite_grads())
        self.engine.zero_grad()

        # Share the loss (and each stage's schedule statistics) along the pipeline so rank 0 can report it.
        measured = stats.busy_s is not None
        schedule_stats = torch.tensor([stats.busy_s if measured else -1.0, stats.total_s if measured else -1.0,
                                       float(stats.peak_in_flight)], dtype=torch.float64, device=self.device)
        per_stage = _gather_over_pipeline(torch.cat([loss.double().reshape(1), schedule_stats]))
        self.state.iteration = iteration
        self.state.consumed_samples = consumed
        record = {"iteration": iteration, "loss": float(per_stage[self.loss_rank][0]), "grad_norm": step["grad_norm"],
                  "lr": lr, "consumed_samples": self.state.consumed_samples}
        if decoupled_lr is not None:
            record["decoupled_lr"] = decoupled_lr
        if self.batches.ramps:
            record["global_batch_size"] = batch
        if self.cfg.data.eod_mask_loss:   # the tokens the loss averaged over (fewer than global batch x seq)
            record["loss_tokens"] = int(global_tokens)
        record.update(moe_metrics)
        if step["skipped"]:
            record["skipped"] = True
        if "loss_scale" in step:
            record["loss_scale"] = step["loss_scale"]
        t = self.cfg.training
        if not t.fp16 and not t.no_check_for_nan_in_loss_and_grad:   # fp16 skips such steps instead
            check_finite(iteration, record["loss"], step["grad_norm"], local_bad, self.device)
        elif t.fp16 and not t.no_check_for_nan_in_loss_and_grad:   # ... until they overflow at the lowest scale
            check_loss_scale(iteration, self.optimizer.scaler)
        if self.pp > 1:
            if measured:   # idle / compute time up to the end of the slowest stage (the optimizer waits for it)
                span = max(float(stage[2]) for stage in per_stage)
                bubble = [(span - float(stage[1])) / float(stage[1]) for stage in per_stage]
                record["pipeline_bubble"] = sum(bubble) / len(bubble)
                record["pipeline_bubble_per_stage"] = bubble
            record["pipeline_peak_in_flight"] = [int(stage[3]) for stage in per_stage]
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_iters`` global batches (the first ones of the validation set, at the
        largest global batch whatever a ramp-up is at)."""
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
        return float(_gather_over_pipeline(total / tokens)[self.loss_rank])

    def save_checkpoint(self, directory: str):
        """Save model, optimizer, data position and RNG states into ``directory`` (collective; megalite.checkpoint).
        With --async-save the tensors are copied and written in the background: :meth:`finish_save` completes it
        (the loop calls it every iteration and at the end); one save at a time. Returns the directory once saved."""
        self.finish_save()
        self.engine.finish_param_sync()   # the distributed optimizer's parameter gathers must have landed
        pending = checkpoint.start_save(
            directory, cfg=self.cfg, iteration=self.state.iteration, consumed_samples=self.state.consumed_samples,
            parameters=list(self.canonical_named_parameters()), optimizer=self.optimizer, rng=self.rng,
            tokenizer=self.data.tokenizer, device=self.device, asynchronous=self.cfg.checkpoint.async_save,
            fp8_histories=self.fp8_histories)
        self._checkpointed_iteration = self.state.iteration
        self._pending_save = pending
        return self.finish_save(wait=not self.cfg.checkpoint.async_save)

    def finish_save(self, wait: bool = True):
        """Complete the save in flight, if any, once every rank has written it (``wait``: block until then); then
        it is renamed into place and pointed to. Returns its directory, or None if none completed (collective)."""
        pending = self._pending_save
        if pending is None or not (wait or pending.ready()):
            return None
        self._pending_save = None
        path = pending.finish()
        self.logger.print(f"saved checkpoint at iteration {pending.iteration} to {path}")
        return path

    def load_checkpoint(self) -> int | None:
        """Resume from ``--load`` at any layout (see megalite.checkpoint.load); the iteration loaded, or None when
        there is nothing to load yet (--load equal to --save, first run)."""
        c = self.cfg.checkpoint
        self.logger.print(f"megalite: loading checkpoint from {c.load} ...")
        start = time.perf_counter()
        result = checkpoint.load_checkpoint(self.cfg, parameters=list(self.canonical_named_parameters()),
                                            optimizer=self.optimizer, rng=self.rng, device=self.device,
                                            tokenizer=self.data.tokenizer, fp8_histories=self.fp8_histories)
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
                and (iteration % d.eval_interval == 0 or iteration == self.train_iters))

    def train(self) -> list[dict]:
        """Run to the last iteration; return the logged records (every rank computes them, rank 0 writes them)."""
        interval = self.cfg.logging.log_interval
        records, window_start, window_iters, window_samples = [], time.perf_counter(), 0, 0
        profiler = StepProfiler(self.cfg.logging, self.state.iteration)
        self.memory.start()
        while self.state.iteration < self.train_iters:
            profiler.before_step(self.state.iteration)
            record = self.train_step()
            profiler.after_step(self.state.iteration)
            self.memory.collect_if_due(record["iteration"])
            self.finish_save(wait=False)   # a background save whose every rank has written it goes into place
            window_iters += 1
            window_samples += record.get("global_batch_size", self.cfg.training.global_batch_size)
            if record["iteration"] % interval == 0 or record["iteration"] == self.train_iters:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                window_s = time.perf_counter() - window_start
                record["elapsed_ms"] = window_s / window_iters * 1000.0
                record["tokens_per_sec"] = window_samples * self.cfg.model.seq_length / window_s
                record["consumed_tokens"] = self.state.consumed_samples * self.cfg.model.seq_length
                devices = dist.get_world_size() if dist.is_initialized() else 1
                record["tflops_per_device"] = self.flops_per_sample * window_samples / window_s / devices / 1e12
                if self.peak_tflops:
                    record["mfu"] = record["tflops_per_device"] / self.peak_tflops
                record["peak_memory_gib"] = peak_memory_gib(self.device)
                record.update(self.timers.report(window_iters))
                self.logger.log(record)
                records.append(record)
                window_start, window_iters, window_samples = time.perf_counter(), 0, 0
            if self._should_evaluate(record["iteration"]):
                with self.memory.around_evaluation():
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
        profiler.close()
        if self.cfg.checkpoint.save and self._checkpointed_iteration != self.state.iteration:
            self.save_checkpoint(self.cfg.checkpoint.save)
        self.finish_save()   # the end of training waits for a save still in flight
        self.engine.finish_param_sync()
        self.prefetcher.close()
        self.memory.finish()
        self.logger.close()
        return records
