"""Optimizer construction, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import torch

from megalite.config import OptimizerConfig
from megalite.optimizer.clip_grads import clip_grad_norm_, global_grad_norm
from megalite.optimizer.lr_schedule import learning_rate


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW without weight decay on biases and norm weights (every 1-D parameter), as Megatron does."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


__all__ = ["build_optimizer", "learning_rate", "clip_grad_norm_", "global_grad_norm"]
