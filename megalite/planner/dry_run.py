"""``pretrain_gpt.py --dry-run``: the planner's per-GPU memory estimate for the layout on the command line.

Runs after the options and data files are checked and before any process group exists, so it needs no GPU and no
other rank. The vocabulary is the tokenizer's, as the trainer will use it (--vocab-size only sizes mock data).
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.config import MegaliteConfig
from megalite.data import run_vocab_size
from megalite.planner.hardware import GiB
from megalite.planner.layout import Layout
from megalite.model.flops import model_flops_per_iteration
from megalite.planner.memory import Numerics, StageMemory, expert_state_bytes, memory_per_stage
from megalite.planner.parameters import count_parameters
from megalite.planner.performance import all_to_all_bytes


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
    model = dataclasses.replace(cfg.model, vocab_size=run_vocab_size(cfg))
    stages = memory_per_stage(model, layout, cfg.training.global_batch_size, dtype_bytes=dtype_bytes(cfg),
                              numerics=numerics_for(cfg, cuda), bucket_size=cfg.optimizer.ddp_bucket_size)
    return layout, stages


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
            f"expert gradients reduced over DP / EP = {layout.expert_dp} ranks",
            f"  token dispatch ({model.moe_token_dispatcher_type}): {traffic / GiB:.3f} GiB sent per GPU per step "
            f"over the expert-parallel group; {flops / 1e12:,.2f} TFLOP per step of the active parameters"]


def format_dry_run(cfg: MegaliteConfig, world_size: int, cuda: bool | None = None) -> str:
    """What --dry-run prints: the layout, the parameters, and each stage's memory split, most loaded marked."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    layout, stages = run_memory(cfg, world_size, cuda)
    model = dataclasses.replace(cfg.model, vocab_size=run_vocab_size(cfg))
    params = count_parameters(model, layout.tp, layout.pp, layout.virtual_stages, layout.ep, layout.expert_tp)
    m = layout.num_micro_batches(cfg.training.global_batch_size)
    active = (f" ({params.active / 1e6:,.2f}M active per token: {model.moe_router_topk} of {model.num_experts} "
              f"experts)" if params.is_moe else "")
    lines = [f"megalite: dry run: {layout.describe()}, {m} micro-batches per step; {params.total / 1e6:,.2f}M "
             f"parameters{active}; {'bf16' if cfg.training.bf16 else 'fp16' if cfg.training.fp16 else 'fp32'}; "
             f"activations as {'CUDA' if cuda else 'the CPU'} keeps them",
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
    if layout.zero == 3:
        lines.append("  gathered: ZeRO-3's working memory, the layers FSDP2 gathers for compute and their unsharded "
                     "gradients")
    if params.is_moe:
        lines += _experts_lines(cfg, model, layout, peak, dtype_bytes(cfg), m)
    if peak.host:
        what = "parameter, gradient and optimizer" if peak.host_weights else "optimizer"
        lines.append(f"  plus {peak.host / GiB:.3f} GiB of {what} states on the host (CPU offload)")
    if cuda:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        verdict = "fits" if peak.total <= 0.9 * total else "does NOT fit"
        lines.append(f"this GPU has {total / GiB:.1f} GiB: the most loaded stage {verdict} with 10% headroom")
    return "\n".join(lines)
