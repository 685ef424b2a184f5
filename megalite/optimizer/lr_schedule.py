"""Learning rate as a pure function of the 1-based iteration: linear warm-up, then decay to min_lr.

lr(k) = lr * k / warmup                                       for k <= warmup
      = min_lr + (lr - min_lr) * f((k - warmup) / (decay - warmup))  up to the decay iteration, then min_lr
with f(r) = (1 + cos(pi r)) / 2 (cosine), 1 - r (linear), 1 (constant). Unlike Megatron, iteration 1 already gets
lr / warmup rather than 0, so no step is wasted.
"""

from __future__ import annotations

import math

from megalite.config import OptimizerConfig


def learning_rate(iteration: int, cfg: OptimizerConfig, train_iters: int) -> float:
    warmup = cfg.lr_warmup_iters
    decay = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else train_iters
    if warmup > 0 and iteration <= warmup:
        return cfg.lr * iteration / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if iteration >= decay:
        return cfg.min_lr
    ratio = (iteration - warmup) / (decay - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * ratio)) if cfg.lr_decay_style == "cosine" else 1.0 - ratio
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
