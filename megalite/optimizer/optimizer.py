"""AdamW (or Muon for the matrices) over fp32 main parameters: whole, or sharded over data-parallel ranks.

The optimizer steps the data-parallel engine's *pieces*: for each model parameter, the part of it this rank updates
(see megalite.distributed.engine). Without the distributed optimizer a piece is the whole parameter; with it, it is
the intersection of the parameter's range in the flat buffer with this rank's shard of the bucket, so Adam states
exist once across the DP group (ZeRO-1/2); at ZeRO-3, this rank's row shard. Each piece gets a main copy in fp32:
the parameter's own storage when the model is fp32 (no copy at all), a separate fp32 copy when the model is
bf16/fp16, and a CPU copy with ``optimizer_cpu_offload`` (stepped by the fused C++ Adam). On CUDA, AdamW is torch's
fused kernel (:func:`fused_adamw`).

One step: unscale fp16 gradients and skip the step on every rank if any rank overflowed; the exact global norm and
clipping; AdamW; write main copies back into the parameters; all-gather the shards (distributed optimizer). With
``--optimizer muon`` the hidden matrices' pieces are stepped by :class:`~megalite.optimizer.muon.Muon` instead of
AdamW (same main copies, same clipped gradients; one momentum buffer per piece instead of two moments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megalite import parallel_state
from megalite.config import OptimizerConfig, TrainingConfig
from megalite.distributed.engine import DataParallelEngine, Piece
from megalite.optimizer.clip_grads import clip_by_global_norm_, global_grad_norm
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.optimizer.muon import Muon, MuonSettings, is_muon_matrix

ADAM_STATES = ("exp_avg", "exp_avg_sq")
MUON_STATES = ("momentum_buffer",)


def is_embedding_or_output(param: torch.nn.Parameter) -> bool:
    """The word embedding or the output layer (or its copy on the last stage): what --decoupled-lr applies to."""
    return getattr(param, "is_embedding_or_output", False)


def fused_adamw(device_types: set[str]) -> bool:
    """Whether AdamW runs as torch's fused kernel (``fused=True``, as Megatron and torchtitan use on GPUs: one
    kernel for all parameters instead of a chain of foreach ops): when every main parameter is on CUDA. Elsewhere
    torch's default (foreach) stays; ``fused=False`` would mean the per-tensor loop."""
    return device_types == {"cuda"}


@dataclass
class MainPiece(Piece):
    """A piece with the fp32 main copy the optimizer updates (which may alias ``model_view``)."""
    main: torch.nn.Parameter

    @classmethod
    def of(cls, piece: Piece, offload: bool) -> MainPiece:
        view = piece.model_view
        device = torch.device("cpu") if offload else view.device
        shared = view.dtype == torch.float32 and view.device == device   # stepping the main copy updates the model
        main = torch.nn.Parameter(view if shared else view.detach().to(device=device, dtype=torch.float32, copy=True))
        return cls(piece.param, piece.start, piece.end, view, piece.grad, main)

    @property
    def aliased(self) -> bool:
        # The same storage at the same place (by the storage itself: meta tensors, the simulated GPUs', have no
        # addresses to compare).
        return (self.main.untyped_storage()._cdata == self.model_view.untyped_storage()._cdata
                and self.main.storage_offset() == self.model_view.storage_offset())


class MegaliteOptimizer:
    def __init__(self, engine: DataParallelEngine, cfg: OptimizerConfig, training: TrainingConfig):
        self.engine, self.cfg = engine, cfg
        self.pieces = [MainPiece.of(piece, cfg.optimizer_cpu_offload) for piece in engine.pieces()]
        muon = [p for p in self.pieces if cfg.optimizer == "muon" and is_muon_matrix(p.param)]
        self.muon = Muon(muon, engine, MuonSettings.from_config(cfg), cfg.weight_decay) if muon else None
        stepped_by_muon = {id(p.main) for p in muon}
        adam = [p for p in self.pieces if id(p.main) not in stepped_by_muon]
        # Weight decay for matrices only (not biases and norm weights); with --decoupled-lr the word embedding and
        # the output layer (flagged by the model) form groups of their own, stepped at their own rate.
        groups = []
        for decoupled in (False, True) if cfg.decoupled_lr is not None else (False,):
            for decay in (True, False):
                params = [p.main for p in adam if (p.param.dim() > 1) == decay
                          and decoupled == (cfg.decoupled_lr is not None and is_embedding_or_output(p.param))]
                groups.append({"params": params, "weight_decay": cfg.weight_decay if decay else 0.0,
                               "decoupled": decoupled})
        kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        if cfg.optimizer_cpu_offload:
            from megalite.optimizer.cpu_adam import CPUAdamW   # builds the C++ kernel on first use
            self.inner: torch.optim.Optimizer = CPUAdamW(groups, **kwargs)
        else:
            fused = fused_adamw({p.main.device.type for p in self.pieces})
            self.inner = torch.optim.AdamW(groups, **kwargs, fused=True if fused else None)
        self.scaler: Optional[ConstantLossScaler | DynamicLossScaler] = None
        if training.fp16:
            self.scaler = (ConstantLossScaler(cfg.loss_scale) if cfg.loss_scale is not None else
                           DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window,
                                             cfg.hysteresis))

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def state_kinds(self, param: torch.nn.Parameter) -> tuple[str, ...]:
        """The optimizer states a piece of ``param`` has (what a checkpoint stores beside its main copy)."""
        return MUON_STATES if self.cfg.optimizer == "muon" and is_muon_matrix(param) else ADAM_STATES

    def piece_states(self, piece: MainPiece) -> dict[str, torch.Tensor]:
        """The states of one piece by kind (:meth:`state_kinds`), made if the optimizer has not stepped yet."""
        if self.muon is not None and self.state_kinds(piece.param) == MUON_STATES:
            return {"momentum_buffer": self.muon.momentum_buffer(piece)}
        return {kind: self.inner.state[piece.main][kind] for kind in ADAM_STATES}

    def state_bytes(self) -> int:
        """Bytes of Adam and Muon states (and separate fp32 main copies) held by this rank."""
        held = list(self.inner.state.values()) + (list(self.muon.state.values()) if self.muon is not None else [])
        states = sum(t.numel() * t.element_size() for s in held for t in s.values()
                     if torch.is_tensor(t) and t.dim() > 0)
        mains = sum(p.main.numel() * 4 for p in self.pieces if not p.aliased)
        return states + mains

    def has_nonfinite_grads(self) -> bool:
        """Whether a gradient this rank steps holds a NaN or an infinity (this rank's pieces only, no collective)."""
        return any(not bool(torch.isfinite(p.grad).all()) for p in self.pieces)

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: Optional[float] = None, loss_finite: bool = True) -> dict:
        """Update the model from the reduced gradients at rate ``lr`` (``decoupled_lr`` for the word embedding and
        output layer, with --decoupled-lr); returns ``grad_norm`` (None when skipped) and flags. ``loss_finite``:
        this rank's loss (if it has one) is finite, which the fp16 loss scaler counts (see its giving up)."""
        grads = [p.grad for p in self.pieces]
        result: dict = {}
        if self.scaler is not None:
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
            device = self.engine.device
            found_inf = parallel_state.any_rank(self.has_nonfinite_grads(), device)
            # Only on a skipped step (every rank knows it is one) is the loss's finiteness agreed: one more collective
            # there, none on a clean step.
            loss_finite = not found_inf or not parallel_state.any_rank(not loss_finite, device)
            result["loss_scale"] = self.scaler.scale
            self.scaler.update(found_inf, loss_finite)
            if found_inf:
                return {**result, "grad_norm": None, "skipped": True}
        norm = global_grad_norm([(p.param, p.grad) for p in self.pieces], self.engine.distributed)
        if not math.isfinite(norm):
            return {**result, "grad_norm": norm, "skipped": True}
        clip_by_global_norm_(grads, norm, self.cfg.clip_grad)
        for p in self.pieces:   # bf16 gradients (--grad-reduce-in-bf16) step the fp32 main copy in fp32
            same = p.grad.device == p.main.device and p.grad.dtype == p.main.dtype
            p.main.grad = p.grad if same else p.grad.to(p.main.device, p.main.dtype)
        for group in self.inner.param_groups:
            group["lr"] = decoupled_lr if group["decoupled"] else lr
        self.inner.step()
        if self.muon is not None:
            self.muon.step(lr)
        for p in self.pieces:
            p.main.grad = None
            if not p.aliased:
                p.model_view.copy_(p.main)
        self.engine.gather_params()
        return {**result, "grad_norm": norm, "skipped": False}
