"""AdamW over fp32 main parameters: whole, or sharded over data-parallel ranks (the distributed optimizer).

The optimizer works on *fragments*: for each model parameter, the piece of it this rank updates. Without the
distributed optimizer a fragment is the whole parameter; with it, it is the intersection of the parameter's range in
the flat buffer with this rank's shard of the bucket, so Adam states exist once across the DP group (ZeRO-1/2). A
fragment's main copy is fp32: the parameter's own storage when the model is fp32 (no copy at all), a separate fp32
copy when the model is bf16/fp16, and a CPU copy with ``optimizer_cpu_offload`` (stepped by the fused C++ Adam).

One step: unscale fp16 gradients and skip the step on every rank if any rank overflowed; the exact global norm and
clipping; AdamW; write main copies back into the parameters; all-gather the shards (distributed optimizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import OptimizerConfig, TrainingConfig
from megalite.distributed import DataParallel, FullyShardedDataParallel
from megalite.optimizer.clip_grads import clip_by_global_norm_, global_grad_norm
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler


@dataclass
class Fragment:
    param: torch.nn.Parameter      # the model parameter the fragment belongs to
    start: int                     # [start, end) in the data-parallel engine's flat buffers
    end: int
    model_view: torch.Tensor       # the parameter's elements, 1-D, in the model's dtype
    grad: torch.Tensor             # the summed gradient of those elements, fp32, 1-D
    main: torch.nn.Parameter       # fp32 main copy the optimizer updates (may alias model_view)

    @property
    def aliased(self) -> bool:
        return self.main.data_ptr() == self.model_view.data_ptr()


def _fragments(engine: DataParallel | FullyShardedDataParallel, offload: bool) -> list[Fragment]:
    fragments = []
    for piece in engine.pieces():
        model_view = piece.model_view
        device = torch.device("cpu") if offload else model_view.device
        if model_view.dtype == torch.float32 and model_view.device == device:
            main = torch.nn.Parameter(model_view)     # shares storage: stepping it updates the model
        else:
            main = torch.nn.Parameter(model_view.detach().to(device=device, dtype=torch.float32, copy=True))
        fragments.append(Fragment(piece.param, piece.start, piece.end, model_view, piece.grad, main))
    return fragments


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is True on any rank of this model replica's groups."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    for info in (parallel_state.get_model_parallel_group(), parallel_state.get_data_parallel_group()):
        if info.size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=info.group)
    return bool(value.item() > 0)


class MegaliteOptimizer:
    def __init__(self, ddp: DataParallel | FullyShardedDataParallel, cfg: OptimizerConfig, training: TrainingConfig):
        self.ddp, self.cfg = ddp, cfg
        self.fragments = _fragments(ddp, cfg.optimizer_cpu_offload)
        decay = [f.main for f in self.fragments if f.param.dim() > 1]
        no_decay = [f.main for f in self.fragments if f.param.dim() <= 1]   # biases and norm weights
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        if cfg.optimizer_cpu_offload:
            from megalite.optimizer.cpu_adam import CPUAdamW   # builds the C++ kernel on first use
            self.inner: torch.optim.Optimizer = CPUAdamW(groups, **kwargs)
        else:
            self.inner = torch.optim.AdamW(groups, **kwargs)
        self.scaler: Optional[ConstantLossScaler | DynamicLossScaler] = None
        if training.fp16:
            self.scaler = (ConstantLossScaler(cfg.loss_scale) if cfg.loss_scale is not None else
                           DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window,
                                             cfg.hysteresis))

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def state_bytes(self) -> int:
        """Bytes of Adam states (and separate fp32 main copies) held by this rank."""
        states = sum(t.numel() * t.element_size() for s in self.inner.state.values()
                     for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        mains = sum(f.main.numel() * 4 for f in self.fragments if not f.aliased)
        return states + mains

    @torch.no_grad()
    def step(self, lr: float) -> dict:
        """Update the model from the reduced gradients; returns ``grad_norm`` (None when skipped) and flags."""
        grads = [f.grad for f in self.fragments]
        device = self.ddp.device
        result: dict = {}
        if self.scaler is not None:
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
            found_inf = any(not bool(torch.isfinite(g).all()) for g in grads)
            found_inf = _any_rank(found_inf, device)
            result["loss_scale"] = self.scaler.scale
            self.scaler.update(found_inf)
            if found_inf:
                return {**result, "grad_norm": None, "skipped": True}
        norm = global_grad_norm([(f.param, f.grad) for f in self.fragments], self.ddp.distributed)
        if not math.isfinite(norm):
            return {**result, "grad_norm": norm, "skipped": True}
        clip_by_global_norm_(grads, norm, self.cfg.clip_grad)
        for f in self.fragments:
            f.main.grad = f.grad if f.grad.device == f.main.device else f.grad.to(f.main.device)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        for f in self.fragments:
            f.main.grad = None
            if not f.aliased:
                f.model_view.copy_(f.main)
        self.ddp.gather_params()
        return {**result, "grad_norm": norm, "skipped": False}
