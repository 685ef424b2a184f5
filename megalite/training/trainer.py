"""The training loop: one iteration is data -> pipeline schedule of forward/backward steps over micro-batches ->
gradient reduction over DP (and the tied-embedding sum across stages) -> optimizer step (unscale, clip, AdamW,
parameter gather) -> log; every ``eval_interval`` iterations, the validation loss over ``eval_iters`` global batches
(the same validation samples each time, so evaluations are comparable).

The loss is normalized by the number of tokens in the whole global batch (global batch x sequence length, or the
tokens left by ``--eod-mask-loss`` or ``--sft``'s loss mask, counted over every rank), so each rank backpropagates
its share of the global mean and the DP reduction is a plain sum: the result is the same whatever the DP size or
micro-batch size, which is what the equivalence tests check. Under context parallelism each rank holds some tokens
of every sample of its DP rank's micro-batches (megalite.model.context_parallel); their loss sums over DP x CP like
the DP ranks' do.

With multi-token prediction each depth's loss is normalized likewise, by the tokens that count at that depth over the
global batch (fewer: the last k of each sample have no label k + 1 places ahead); the objective adds
--mtp-loss-scaling-factor times their mean over the depths to the loss. ``loss`` stays the language-model loss (the
same number a run without MTP reports); ``mtp_loss`` is that mean over the depths (``mtp_losses``: each depth's).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import checkpoint, parallel_state
from megalite.config import ConfigError, MegaliteConfig
from megalite.config.batches import batch_schedule, describe as describe_batches, train_iterations
from megalite.config.flags import FLAG
from megalite.data import build_datasets, micro_batch_indices
from megalite.data.packing import packed_documents
from megalite.distributed import is_expert
from megalite.model.context_parallel import SequenceShard, shard_sequence
from megalite.model.multi_token_prediction import MultiTokenTargets, multi_token_targets
from megalite.model.flops import model_flops_per_iteration
from megalite.run import Run
from megalite.optimizer import LRSchedule, MegaliteOptimizer
from megalite.optimizer.clip_grads import counts_toward_norm
from megalite.tensor_parallel import Fp8Recipe
from megalite.tensor_parallel.fp8 import has_fp8_tensor_cores
from megalite.training.hooks import DelayedFp8Scales, StepHook
from megalite.training.housekeeping import MemoryHousekeeping
from megalite.training.metrics import MetricsLogger
from megalite.training.moe_statistics import MoEStatistics
from megalite.training.parallelize import parallelize
from megalite.training.profiling import StepProfiler
from megalite.training.step_times import StepTimeRecorder
from megalite.training.stopping import StopRequests, TrainingError, check_finite, check_loss_scale
from megalite.training.prefetch import BatchPrefetcher
from megalite.training.timers import Timers, peak_memory_gib, peak_tflops


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
    parallel_state.get_model_parallel_group().sum(dense)
    parallel_state.get_model_parallel_group().sum(routed)
    return dense, parallel_state.get_expert_model_parallel_group().sum(routed)


@dataclass
class MicroBatch:
    """What one micro-batch feeds this rank: its tokens of the samples (all of them without context parallelism),
    the next tokens as labels, which of them count in the loss, and where they sit in the samples."""
    inputs: torch.Tensor      # [micro-batch, local tokens]
    labels: torch.Tensor      # [micro-batch, local tokens]
    loss_mask: torch.Tensor   # [micro-batch, local tokens], fp32
    shard: SequenceShard
    mtp: MultiTokenTargets | None = None   # with --mtp-num-layers

    @classmethod
    def of(cls, samples: torch.Tensor, cfg: MegaliteConfig, eod: int | None) -> "MicroBatch":
        """From samples of seq length + 1 tokens [micro-batch, seq + 1] (with --sft [micro-batch, 2, seq + 1]: the
        tokens and which count as labels); ``eod`` ends the packed documents."""
        trained = None   # --sft: which labels are trained (the assistant's tokens)
        if samples.dim() == 3:
            samples, trained = samples[:, 0], samples[:, 1, 1:]
        inputs, labels = samples[:, :-1], samples[:, 1:]
        d = cfg.data
        packing = (packed_documents(inputs, eod, reset_position_ids=d.reset_position_ids,
                                    reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss)
                   if eod is not None else None)
        levels = cfg.parallel.hierarchical_context_parallel()   # --cp-comm-type a2a+p2p: (a2a size, p2p size)
        shard = shard_sequence(inputs.shape[1], samples.device, comm_type=cfg.parallel.cp_comm_type,
                               a2a_size=levels[0] if levels else 1, positions=packing.positions if packing else None,
                               documents=packing.documents if packing else None)
        loss_mask = packing.loss_mask if packing is not None else torch.ones_like(labels, dtype=torch.float32)
        if trained is not None:
            loss_mask = loss_mask * trained.float()
        depth = cfg.model.mtp_num_layers
        mtp = (multi_token_targets(samples, depth, loss_mask, packing.documents if packing else None, shard)
               if depth else None)
        return cls(shard.take(inputs), shard.take(labels), shard.take(loss_mask), shard, mtp)


@dataclass
class TrainState:
    iteration: int = 0            # optimizer steps taken
    consumed_samples: int = 0


class Trainer:
    """Runs iterations of this rank's part of a run (megalite.training.parallelize: its chunks, data-parallel engine
    and pipeline) with its optimizer, data and step hooks, on the registered layout."""

    def __init__(self, run: Run, device: torch.device):
        cfg, t, d, lg = run.cfg, run.cfg.training, run.cfg.data, run.cfg.logging
        self.cfg, self.dims, self.device = cfg, run.dims, device
        # The global batch of each iteration (constant, or ramping up with the consumed samples) and the run's length.
        self.batches = batch_schedule(t, cfg.model.seq_length)
        self.train_iters = train_iterations(t, self.batches)
        valid_samples = d.eval_iters * t.global_batch_size if d.eval_interval > 0 else 0
        self.data = build_datasets(cfg, (self.batches.consumed_after(self.train_iters), valid_samples, 0),
                                   run.tokenizer)
        rank_zero = not dist.is_initialized() or dist.get_rank() == 0
        if valid_samples and d.eval_iters > 0 and self.data.valid is None and rank_zero:
            # Megatron skips evaluation here too; say so once, rather than leave the eval_loss missing unexplained.
            print(f"megalite: warning: {FLAG.split} {d.split} leaves the validation split no documents: no "
                  f"evaluation, although {FLAG.eval_interval} {d.eval_interval} asks for one (give the split a "
                  f"share, or {FLAG.eval_interval} 0)", flush=True)
        self.model, self.engine, self.pipeline, self.rng, self.dtype = parallelize(run, device)
        # The FP8 linears' amax histories (delayed recipe), by canonical name (checkpoints keep them).
        self.fp8_histories = [found for chunk in self.model for found in chunk.canonical_fp8_histories()]
        self.hooks: list[StepHook] = [MoEStatistics(self.model, cfg.model, t.micro_batch_size, device),
                                      DelayedFp8Scales(self.fp8_histories)]
        self.optimizer = MegaliteOptimizer(self.engine, cfg.optimizer, t)
        self.lr_schedule = LRSchedule.from_config(cfg.optimizer, t, cfg.model.seq_length)
        self.state = TrainState()
        # Micro-batches per step at the largest (evaluation's) global batch; a ramp-up runs fewer while it grows.
        self.num_micro_batches = self.micro_batches_in(t.global_batch_size)
        # --timing-log-level 2: the logged iterations' step times, for timelines.
        self.step_times = (StepTimeRecorder(lg, self.train_iters, self.pipeline, self.num_micro_batches, device)
                           if StepTimeRecorder.wanted(lg.timing_log_level, lg.metrics_file) else None)
        self.logger = MetricsLogger(lg, not dist.is_initialized() or dist.get_rank() == 0, self.train_iters, cfg)
        # The iteration the latest saved (or loaded) checkpoint holds, so the end of training does not save it again.
        self._checkpointed_iteration = self.load_checkpoint() if cfg.checkpoint.load else None
        self._pending_save: checkpoint.PendingSave | None = None   # an --async-save still being written
        self.stop_requests = StopRequests(t, device)
        self.timers = Timers(lg.timing_log_level, device)
        self.prefetcher = BatchPrefetcher(lambda consumed, n: self.samples(self.data.train, consumed, n),
                                          enabled=not d.no_data_prefetch)
        self.memory = MemoryHousekeeping(t, device)
        self.peak_tflops = peak_tflops(device, lg.peak_tflops)
        self.flops_per_sample = model_flops_per_iteration(cfg.model, 1)

    @classmethod
    def on_registered_layout(cls, cfg: MegaliteConfig, device: torch.device) -> "Trainer":
        """The trainer of ``cfg`` as it is, at the size of the layout already registered (tools, benchmarks and
        tests that build their own groups; pretrain_gpt resolves and checks the run from the world first)."""
        return cls(Run.of(cfg, parallel_state.layout_size()), device)

    def describe(self) -> str:
        """One line for the start of a run: layout, schedule, model size, data."""
        dense, routed = parameter_counts(self.engine.params, self.device)
        m, p, dims = self.cfg.model, self.pipeline, self.dims
        total, experts = float(dense + routed), float(routed)
        moe = (f" ({total - experts * (1 - m.moe_router_topk / m.num_experts):,.0f} active per token, EP={dims.ep})"
               if m.num_experts else "")
        schedule = {"1f1b": "1F1B", "zero-bubble": "ZB-H1", "zbv": "ZB-V"}[p.schedule_name]
        if p.pp == 1:
            schedule = "no pipelining"
        elif p.virtual_stages > 1 and p.schedule_name != "zbv":
            schedule = f"interleaved {schedule}"
        data = "mock data" if self.data.tokenizer is None else f"vocabulary {self.data.vocab_size}"
        o = self.cfg.optimizer
        sharding = {0: "unsharded optimizer", 3: "ZeRO-3 (FSDP2)"}.get(o.zero_level, f"ZeRO-{o.zero_level}")
        offload = (", parameters and optimizer on the CPU" if o.offload_params else
                   ", optimizer on the CPU" if o.optimizer_cpu_offload else "")
        micro = (f"{self.micro_batches_in(self.batches.smallest)}-{self.num_micro_batches}" if self.batches.ramps
                 else f"{self.num_micro_batches}")
        context = f"CP={dims.cp} ({self.cfg.parallel.cp_comm_type}) x " if dims.cp > 1 else ""
        return (f"megalite: TP={dims.tp} x {context}PP={p.pp} x DP={dims.dp} (V={p.virtual_stages}, {schedule}, "
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
        return self.dims.micro_batches(global_batch_size, self.cfg.training.micro_batch_size)

    def samples(self, dataset, consumed_samples: int, num_micro_batches: int) -> list[torch.Tensor]:
        """This DP rank's samples of the global batch, one [micro-batch, seq + 1] tensor per micro-batch, on the host
        (in pinned memory on a GPU, for an asynchronous copy); run by the prefetch thread for training batches."""
        t = self.cfg.training
        indices = micro_batch_indices(consumed_samples, t.micro_batch_size, num_micro_batches,
                                      parallel_state.get_data_parallel_rank(), self.dims.dp)
        stacked = [torch.stack([dataset[i] for i in batch]) for batch in indices]
        return [s.pin_memory() for s in stacked] if self.device.type == "cuda" else stacked

    def micro_batches(self, samples: list[torch.Tensor]) -> list[MicroBatch]:
        """This rank's micro-batches of the global batch: its DP rank's samples, its CP rank's tokens of them."""
        d = self.cfg.data
        packing = d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss
        eod = self.data.tokenizer.eod if packing else None   # validation refused packing without a tokenizer
        cuda = self.device.type == "cuda"
        return [MicroBatch.of(s.to(self.device, non_blocking=cuda), self.cfg, eod) for s in samples]

    def _run_global_batch(self, samples: list[torch.Tensor], global_batch_size: int, forward_only: bool,
                          record_steps: bool = False):
        """Forward (and backward) one global batch of ``global_batch_size`` samples (``samples``, from
        :meth:`samples`) through the pipeline schedule (``record_steps``: with its steps' times, clocks aligned over
        the pipeline).

        Returns (loss summed over this rank's tokens, token count of the whole global batch, schedule stats).
        Training with multi-token prediction leaves in ``mtp_sums`` each depth's loss summed over this rank's tokens
        and in ``mtp_tokens`` its token count of the whole global batch."""
        micro_batches = self.micro_batches(samples)
        m = self.cfg.model
        mtp = m.mtp_num_layers is not None and not forward_only   # evaluation reports the language-model loss only
        if self.cfg.data.masks_loss() or mtp:   # the tokens that count, over every rank's share of the global batch
            # Waited for only where the first loss is scaled by it: overlapped parameter gathers still in flight on
            # this group come before it, and the first forward need not wait for them all. With MTP: each depth's.
            counted = torch.stack([torch.cat([b.loss_mask.sum().reshape(1)] +
                                             ([b.mtp.loss_mask.sum(dim=(1, 2))] if mtp else []))
                                   for b in micro_batches]).sum(dim=0)
            work = parallel_state.get_data_parallel_group(with_context_parallel=True).start_sum(counted)

            def global_tokens_now() -> torch.Tensor:
                nonlocal work
                if work is not None:   # waited for once
                    work.wait()
                    work = None
                return counted.clamp(min=1.0)
        else:   # every token counts (our samples have no padding): the count needs no all-reduce
            tokens = torch.tensor([float(global_batch_size * m.seq_length)], device=self.device)
            global_tokens_now = lambda: tokens   # noqa: E731
        loss_sums: list[torch.Tensor] = []
        mtp_sums: list[torch.Tensor] = []
        loss_scale = self.optimizer.loss_scale   # 1 unless fp16

        def forward_step(chunk_index: int, micro_batch: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
            chunk, batch = self.model[chunk_index], micro_batches[micro_batch]
            mask = batch.loss_mask
            output = chunk(batch.inputs if chunk.pre_process else input_tensor,
                           batch.labels if chunk.post_process else None, batch.shard,
                           mtp=batch.mtp if mtp and chunk.post_process else None)
            if not chunk.post_process:
                return output
            if mtp:
                output, mtp_losses = output
            loss_sum = (output.float() * mask).sum()
            loss_sums.append(loss_sum.detach())
            counts = global_tokens_now()
            objective = loss_sum * (loss_scale / counts[0])
            if mtp:   # each depth's mean over the global batch, their mean over the depths, scaled
                depth_sums = (mtp_losses.float() * batch.mtp.loss_mask).sum(dim=(1, 2))
                mtp_sums.append(depth_sums.detach())
                weight = m.mtp_loss_scaling_factor / m.mtp_num_layers * loss_scale
                objective = objective + (depth_sums / counts[1:]).sum() * weight
            return objective

        if record_steps:
            self.step_times.align()
        stats = self.pipeline.run(len(micro_batches), forward_step, forward_only)
        loss_sum = torch.stack(loss_sums).sum() if loss_sums else torch.zeros((), device=self.device)
        if mtp:
            self.mtp_sums = (torch.stack(mtp_sums).sum(dim=0) if mtp_sums
                             else torch.zeros(m.mtp_num_layers, device=self.device))
            self.mtp_tokens = global_tokens_now()[1:]
        return loss_sum, global_tokens_now()[0], stats

    def forward_backward(self, dataset, consumed_samples: int, global_batch_size: int | None = None,
                         samples: list[torch.Tensor] | None = None):
        """One global batch's forward and backward passes (``global_batch_size`` samples, default the largest, read
        from ``dataset`` unless given as ``samples``), its gradients summed over DP: the first part of a training
        step. Returns (loss summed over this rank's tokens, token count of the whole global batch, schedule stats)."""
        batch = global_batch_size or self.cfg.training.global_batch_size
        num_micro_batches = self.micro_batches_in(batch)
        if samples is None:
            samples = self.samples(dataset, consumed_samples, num_micro_batches)
        self.engine.start_iteration(num_micro_batches)
        for hook in self.hooks:
            hook.before_forward_backward(self.optimizer.loss_scale, batch)
        # Step times are recorded at the largest batch only: the recorder's schedules are those of that batch.
        record_steps = (self.step_times is not None and batch == self.cfg.training.global_batch_size
                        and self.step_times.records(self.state.iteration + 1))
        with self.timers("forward-backward"):
            loss_sum, global_tokens, stats = self._run_global_batch(samples, batch, False, record_steps)
        self.memory.after_forward_backward()
        if record_steps:
            self.step_times.write(self.state.iteration + 1, stats.step_times, stats.wall_start)
        if stats.busy_s is not None:
            self.timers.add("pipeline-wait", stats.total_s - stats.busy_s)
        with self.timers("grads-reduce"):
            self.engine.finish_grad_sync()
        return loss_sum, global_tokens, stats

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
        loss_sum, global_tokens, stats = self.forward_backward(self.data.train, consumed, batch, samples)
        hook_metrics = {}
        for hook in self.hooks:   # MoE: global loads and losses, expert biases updated
            hook_metrics.update(hook.after_grad_sync())
        # Only the last stage has the loss: sum it over DP before the optimizer step launches the parameter
        # gathers (overlapped ones would otherwise queue this all-reduce, on the same group, behind every one of
        # them, and the next forward behind it).
        local_bad = not bool(torch.isfinite(loss_sum))
        data_context = parallel_state.get_data_parallel_group(with_context_parallel=True)
        mtp = self.cfg.model.mtp_num_layers is not None
        if mtp:   # each depth's loss summed with it (one all-reduce), over its own token count
            summed = data_context.sum(torch.cat([loss_sum.reshape(1), self.mtp_sums]))
            loss, mtp_losses = summed[0] / global_tokens, summed[1:] / self.mtp_tokens
        else:
            loss = data_context.sum(loss_sum.clone()) / global_tokens

        iteration = self.state.iteration + 1
        o, consumed = self.cfg.optimizer, self.state.consumed_samples + batch
        lr = self.lr_schedule.at(consumed, o.lr, o.min_lr)
        decoupled_lr = (None if o.decoupled_lr is None else
                        self.lr_schedule.at(consumed, o.decoupled_lr, o.min_lr if o.decoupled_min_lr is None
                                            else o.decoupled_min_lr))
        for hook in self.hooks:   # FP8: the next delayed scales
            hook.before_optimizer_step()
        with self.timers("optimizer"):   # unscale, clip, AdamW, and the parameter gather unless overlapped
            step = self.optimizer.step(lr, decoupled_lr, loss_finite=not local_bad)
        self.memory.after_step()
        # Which ranks saw a NaN/Inf (only looked for when the global norm, equal on every rank, is not finite).
        norm_bad = step["grad_norm"] is not None and not math.isfinite(step["grad_norm"])
        local_bad = local_bad or (norm_bad and self.optimizer.has_nonfinite_grads())
        self.engine.zero_grad()

        # Share the loss (and each stage's schedule statistics) along the pipeline so rank 0 can report it.
        measured = stats.busy_s is not None
        schedule_stats = torch.tensor([stats.busy_s if measured else -1.0, stats.total_s if measured else -1.0,
                                       float(stats.peak_in_flight)], dtype=torch.float64, device=self.device)
        per_stage = _gather_over_pipeline(torch.cat([loss.double().reshape(1), schedule_stats] +
                                                    ([mtp_losses.double()] if mtp else [])))
        self.state.iteration = iteration
        self.state.consumed_samples = consumed
        record = {"iteration": iteration, "loss": float(per_stage[self.pipeline.loss_rank][0]),
                  "grad_norm": step["grad_norm"], "lr": lr, "consumed_samples": self.state.consumed_samples}
        if mtp:
            depths = per_stage[self.pipeline.loss_rank][4:].tolist()
            record["mtp_loss"] = sum(depths) / len(depths)
            if len(depths) > 1:
                record["mtp_losses"] = depths
        if decoupled_lr is not None:
            record["decoupled_lr"] = decoupled_lr
        if self.batches.ramps:
            record["global_batch_size"] = batch
        if self.cfg.data.masks_loss():   # the tokens the loss averaged over (fewer than global batch x seq)
            record["loss_tokens"] = int(global_tokens)
        record.update(hook_metrics)
        if step["skipped"]:
            record["skipped"] = True
        if "loss_scale" in step:
            record["loss_scale"] = step["loss_scale"]
        t = self.cfg.training
        if not t.fp16 and not t.no_check_for_nan_in_loss_and_grad:   # fp16 skips such steps instead
            check_finite(iteration, record["loss"], step["grad_norm"], local_bad, self.device)
        elif t.fp16 and not t.no_check_for_nan_in_loss_and_grad:   # ... until no scale can fix them
            check_loss_scale(iteration, self.optimizer.scaler)
        if self.pipeline.pp > 1:
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
        batch = self.cfg.training.global_batch_size
        for k in range(self.cfg.data.eval_iters):
            samples = self.samples(self.data.valid, k * batch, self.num_micro_batches)
            loss_sum, global_tokens, _ = self._run_global_batch(samples, batch, forward_only=True)
            total += loss_sum
            tokens += global_tokens
        self.model.train()
        total = parallel_state.get_data_parallel_group(with_context_parallel=True).sum(total)
        return float(_gather_over_pipeline(total / tokens)[self.pipeline.loss_rank])

    def save_checkpoint(self, directory: str):
        """Save model, optimizer, data position and RNG states into ``directory`` (collective; megalite.checkpoint).
        With --async-save the tensors are copied and written in the background: :meth:`finish_save` completes it
        (the loop calls it every iteration and at the end); one save at a time. Returns the directory once saved."""
        self.finish_save()
        self.engine.finish_param_sync()   # the distributed optimizer's parameter gathers must have landed
        try:
            pending = checkpoint.start_save(
                directory, cfg=self.cfg, iteration=self.state.iteration, consumed_samples=self.state.consumed_samples,
                parameters=list(self.canonical_named_parameters()), optimizer=self.optimizer, rng=self.rng,
                tokenizer=self.data.tokenizer, device=self.device, asynchronous=self.cfg.checkpoint.async_save,
                fp8_histories=self.fp8_histories)
        except checkpoint.NotFiniteError as error:   # NaN/inf weights: the run cannot go on, and was not saved
            raise TrainingError(str(error)) from None
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
        # A run shorter than its checkpoint would load, train nothing and exit 0: refuse, on every rank alike.
        length = (f"{FLAG.train_samples} {self.cfg.training.train_samples}" if self.cfg.training.train_samples
                  is not None else f"{FLAG.train_iters} {self.train_iters}")
        if result.iteration > self.train_iters:
            raise ConfigError(f"{FLAG.load} {c.load}: the checkpoint is at iteration {result.iteration}, past the "
                              f"run's last ({length} = iteration {self.train_iters}): nothing to train; give "
                              f"{FLAG.train_iters} above {result.iteration} to go on")
        self.state = TrainState(result.iteration, result.consumed_samples)
        for note in [f"loaded checkpoint {result.path} in {time.perf_counter() - start:.1f} s"] + result.notes:
            self.logger.print(note)
        if result.iteration == self.train_iters:
            self.logger.print(f"megalite: the checkpoint is at iteration {result.iteration}, the run's last "
                              f"({length}): nothing left to train")
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
