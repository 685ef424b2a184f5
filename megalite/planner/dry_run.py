"""``pretrain_gpt.py --dry-run``: the planner's per-GPU memory estimate for the layout on the command line.

Runs after the options and data files are checked and before any process group exists, so it needs no GPU and no
other rank. The vocabulary is the tokenizer's, as the trainer will use it (--vocab-size only sizes mock data). With a
batch-size ramp-up the estimate is for its largest (final) global batch, the most micro-batches in flight.
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.config import MegaliteConfig
from megalite.config.batches import batch_schedule, describe
from megalite.pipeline.simulation import schedule_bubble
from megalite.planner.hardware import GiB, Hardware
from megalite.planner.layout import Layout
from megalite.model.flops import model_flops_per_iteration
from megalite.planner.memory import Numerics, StageMemory, expert_state_bytes, memory_per_stage
from megalite.planner.parameters import count_parameters
from megalite.planner.performance import all_to_all_bytes, context_parallel_bytes, muon_step_cost


def dtype_bytes(cfg: MegaliteConfig) -> int:
    return 2 if cfg.training.bf16 or cfg.training.fp16 else 4


def numerics_for(cfg: MegaliteConfig, cuda: bool) -> Numerics:
    """GPU numerics (byte dropout masks, flash attention unless the fused masked softmax replaces it) on CUDA, the
    CPU's otherwise."""
    if not cuda:
        return Numerics.cpu(dtype_bytes(cfg))
    k = cfg.kernels
    masked_softmax = k.use_fused_kernels == "on" and not k.no_masked_softmax_fusion
    return dataclasses.replace(Numerics.gpu(dtype_bytes(cfg)), flash_attention=not masked_softmax)


def run_memory(cfg: MegaliteConfig, world_size: int, cuda: bool | None = None) -> tuple[Layout, list[StageMemory]]:
    """The layout of ``cfg`` at ``world_size`` and the memory of one GPU of each pipeline stage."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    layout = Layout.from_config(cfg, world_size)
    model = cfg.model   # a resolved run's: its vocabulary is the tokenizer's (megalite.run)
    stages = memory_per_stage(model, layout, cfg.training.global_batch_size, dtype_bytes=dtype_bytes(cfg),
                              numerics=numerics_for(cfg, cuda), bucket_size=cfg.optimizer.ddp_bucket_size,
                              prefetch_bucket_size=cfg.optimizer.zero3_prefetch_bucket_size,
                              grad_bytes=2 if cfg.optimizer.grad_reduce_in_bf16 else 4)
    return layout, stages


def _pipeline_line(layout: Layout, num_micro_batches: int) -> list[str]:
    """The schedule and its bubble beside 1F1B's, with PP > 1."""
    if layout.pp == 1:
        return []
    bubble = schedule_bubble(layout.pipeline_schedule, layout.pp, num_micro_batches, layout.virtual_stages)
    line = (f"pipeline schedule {layout.pipeline_schedule}: bubble {bubble:.1%} of compute at equal forward, "
            f"backward and weight-gradient costs")
    if layout.pipeline_schedule != "1f1b":
        v = 1 if layout.pipeline_schedule == "zbv" else layout.virtual_stages
        line += f" (1f1b at V={v}: {schedule_bubble('1f1b', layout.pp, num_micro_batches, v):.1%})"
    return [line]


def _experts_lines(cfg: MegaliteConfig, model, layout: Layout, peak: StageMemory, nbytes: int,
                   micro_batches: int) -> list[str]:
    """A mixture of experts: the experts' share of the states, the all-to-all traffic, the FLOPs of the active
    parameters."""
    experts = expert_state_bytes(model, layout, peak.pp_rank, dtype_bytes=nbytes,
                                 bucket_size=cfg.optimizer.ddp_bucket_size)
    traffic = all_to_all_bytes(model, layout, micro_batches, nbytes)
    flops = model_flops_per_iteration(model, cfg.training.global_batch_size)
    return [f"  experts: {model.num_experts // layout.ep} of {model.num_experts} per rank (EP={layout.ep}), "
            f"{experts / GiB:.3f} GiB of the {peak.states / GiB:.3f} GiB of model states of stage {peak.pp_rank}; "
            f"expert gradients reduced over DP x CP / EP = {layout.expert_dp} ranks",
            f"  token dispatch ({model.moe_token_dispatcher_type}): {traffic / GiB:.3f} GiB sent per GPU per step "
            f"over the expert-parallel group; {flops / 1e12:,.2f} TFLOP per step of the active parameters"]


def _muon_line(model, layout: Layout) -> str:
    """Muon's Newton-Schulz work and communication per step on the busiest GPU (megalite.planner.performance)."""
    cost = muon_step_cost(model, layout, Hardware())
    where = (f"each matrix owned by one of the {layout.replicas} data-parallel ranks"
             if layout.zero and layout.replicas > 1 else "every matrix on every data-parallel rank")
    return (f"  Muon (--muon-tp-mode {layout.muon_tp_mode}, {layout.muon_ns_steps} Newton-Schulz steps, {where}): "
            f"{cost.flops / 1e9:,.2f} GFLOP per step on the busiest GPU, {cost.tp_bytes / 2**20:.2f} MiB in TP "
            f"collectives, {cost.dp_bytes / 2**20:.2f} MiB in the layer-wise distribution; "
            f"{cost.seconds * 1e3:.3g} ms on the planner's default (H100-like) GPUs")


def format_dry_run(cfg: MegaliteConfig, world_size: int, cuda: bool | None = None) -> str:
    """What --dry-run prints: the layout, the parameters, and each stage's memory split, most loaded marked."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    layout, stages = run_memory(cfg, world_size, cuda)
    model = cfg.model   # a resolved run's: its vocabulary is the tokenizer's (megalite.run)
    params = count_parameters(model, layout.tp, layout.pp, layout.virtual_stages, layout.placement, ep=layout.ep,
                              expert_tp=layout.expert_tp, split=layout.split)
    m = layout.num_micro_batches(cfg.training.global_batch_size)   # the largest batch, when it ramps up
    batches = batch_schedule(cfg.training, cfg.model.seq_length)
    ramp = f" at the largest {describe(batches)}" if batches.ramps else ""
    active = (f" ({params.active / 1e6:,.2f}M active per token: {model.moe_router_topk} of {model.num_experts} "
              f"experts)" if params.is_moe else "")
    lines = [f"megalite: dry run: {layout.describe()}, {m} micro-batches per step{ramp}; {params.total / 1e6:,.2f}M "
             f"parameters{active}; {'bf16' if cfg.training.bf16 else 'fp16' if cfg.training.fp16 else 'fp32'}; "
             f"activations as {'CUDA' if cuda else 'the CPU'} keeps them",
             *_pipeline_line(layout, m),
             "memory per GPU (GiB), DP rank 0:",
             f"  {'stage':>5}  {'params':>12}  {'weights':>8}  {'grads':>8}  {'optimizer':>9}  "
             + (f"{'gathered':>8}  " if layout.zero == 3 else "") + f"{'activations':>11}  {'total':>8}"]
    peak = max(stages, key=lambda s: s.total)
    for stage, held in zip(stages, params.per_stage):
        lines.append(f"  {stage.pp_rank:>5}  {held:>12,}  {stage.weights / GiB:>8.3f}  {stage.gradients / GiB:>8.3f}  "
                     f"{stage.optimizer / GiB:>9.3f}  "
                     + (f"{stage.gathered / GiB:>8.3f}  " if layout.zero == 3 else "")
                     + f"{stage.activations / GiB:>11.3f}  {stage.total / GiB:>8.3f}"
                     + ("  <- most loaded" if stage is peak and len(stages) > 1 else ""))
    if layout.cp > 1:
        sent = context_parallel_bytes(model, layout, dtype_bytes(cfg))
        lines.append(f"  context parallelism: each GPU holds {model.seq_length // layout.cp:,} of the "
                     f"{model.seq_length:,} tokens of every sample; its {layout.cp_comm_type} attention sends "
                     f"{sent['forward'] / 2**20:.2f} MiB forward and {sent['backward'] / 2**20:.2f} MiB backward per "
                     f"layer and micro-batch")
    if layout.zero == 3:
        lines.append("  gathered: ZeRO-3's working memory, the layers FSDP2 gathers for compute and their unsharded "
                     "gradients")
    if params.is_moe:
        lines += _experts_lines(cfg, model, layout, peak, dtype_bytes(cfg), m)
    if layout.muon:
        lines.append(_muon_line(model, layout))
    if peak.host:
        what = "parameter, gradient and optimizer" if peak.host_weights else "optimizer"
        lines.append(f"  plus {peak.host / GiB:.3f} GiB of {what} states on the host (CPU offload)")
    if cuda:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        verdict = "fits" if peak.total <= 0.9 * total else "does NOT fit"
        lines.append(f"this GPU has {total / GiB:.1f} GiB: the most loaded stage {verdict} with 10% headroom")
    return "\n".join(lines)
