"""Learning rate as a pure function of the samples consumed: linear warm-up, then decay to min_lr.

Megatron's OptimizerParamScheduler counts samples whether training is iteration- or sample-based, so this does too:

lr(n) = peak * n / warmup                                              for n <= warmup
      = floor + (peak - floor) * f((n - warmup) / (decay - warmup))    up to decay samples, then floor
with f(r) = (1 + cos(pi r)) / 2 (cosine), 1 - r (linear), 1 (constant), and (Megatron's get_optimizer_param_scheduler)
- iteration-based: decay = --lr-decay-iters (default train iters) x G, warmup = --lr-warmup-iters x G, G the
  (final) --global-batch-size;
- sample-based: decay = --lr-decay-samples (default --train-samples), warmup = --lr-warmup-samples;
- --lr-warmup-fraction x decay replaces either warm-up.

n is the samples consumed *through* the iteration being stepped: Megatron evaluates the same formula at the samples
consumed *before* it (its first step gets lr 0), so megalite's iteration k gets Megatron's lr of iteration k + 1 and
no step is wasted. With a constant batch this is lr * k / warmup_iters at iteration k, as before. The embedding and
output layer follow the same curve between --decoupled-lr and --decoupled-min-lr when those are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megalite.config import OptimizerConfig, TrainingConfig
from megalite.config.batches import batch_schedule, train_iterations


@dataclass(frozen=True)
class LRSchedule:
    """The schedule's shape, in samples; :meth:`at` gives the rate between a peak and a floor."""
    warmup: float
    decay: float
    style: str

    @classmethod
    def from_config(cls, optimizer: OptimizerConfig, training: TrainingConfig, seq_length: int) -> LRSchedule:
        o, t = optimizer, training
        if t.train_samples is not None:
            decay = float(o.lr_decay_samples or t.train_samples)
            warmup = float(o.lr_warmup_samples)
        else:
            batch = t.global_batch_size
            iterations = train_iterations(t, batch_schedule(t, seq_length))
            decay = float((o.lr_decay_iters if o.lr_decay_iters is not None else iterations) * batch)
            warmup = float(o.lr_warmup_iters * batch)
        if o.lr_warmup_fraction is not None:
            warmup = o.lr_warmup_fraction * decay
        return cls(warmup, decay, o.lr_decay_style)

    def at(self, samples: float, peak: float, floor: float) -> float:
        if self.warmup > 0 and samples <= self.warmup:
            return peak * samples / self.warmup
        if self.style == "constant":
            return peak
        if samples >= self.decay:
            return floor
        ratio = (samples - self.warmup) / (self.decay - self.warmup)
        factor = 0.5 * (1.0 + math.cos(math.pi * ratio)) if self.style == "cosine" else 1.0 - ratio
        return floor + (peak - floor) * factor


def learning_rate(iteration: int, cfg: OptimizerConfig, train_iters: int) -> float:
    """The iteration-based schedule with a constant batch, in iterations (one sample per iteration gives the same
    ratios): the rate of iteration ``iteration`` of ``train_iters``."""
    decay = float(cfg.lr_decay_iters if cfg.lr_decay_iters is not None else train_iters)
    warmup = cfg.lr_warmup_fraction * decay if cfg.lr_warmup_fraction is not None else float(cfg.lr_warmup_iters)
    return LRSchedule(warmup, decay, cfg.lr_decay_style).at(iteration, cfg.lr, cfg.min_lr)
