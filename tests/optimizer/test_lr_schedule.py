"""The learning-rate schedule: warm-up, decay styles, and Megatron's sample-based maths."""

from __future__ import annotations

import math

import pytest

from megalite.config import OptimizerConfig, TrainingConfig
from megalite.optimizer import LRSchedule, learning_rate


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_style="cosine")
    assert [learning_rate(k, cfg, 14) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert learning_rate(9, cfg, 14) == pytest.approx(0.1 + 0.9 * 0.5)   # halfway through the decay
    assert learning_rate(14, cfg, 14) == pytest.approx(0.1)
    assert learning_rate(20, cfg, 14) == pytest.approx(0.1)


def test_linear_and_constant_and_explicit_decay_iters():
    linear = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_decay_iters=10)
    assert learning_rate(5, linear, 100) == pytest.approx(0.5)
    assert learning_rate(10, linear, 100) == 0.0
    constant = OptimizerConfig(lr=0.3, lr_decay_style="constant", lr_warmup_iters=2)
    assert learning_rate(1, constant, 10) == pytest.approx(0.15)
    assert all(learning_rate(k, constant, 10) == 0.3 for k in range(2, 12))


def test_cosine_is_monotone():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0)
    values = [learning_rate(k, cfg, 50) for k in range(1, 51)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[0] == pytest.approx(0.5 * (1 + math.cos(math.pi / 50)))


def megatron_lr(num_steps: float, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: float,
                style: str) -> float:
    """Megatron's OptimizerParamScheduler.get_lr (init_lr 0), written out: steps are samples."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * float(num_steps) / float(warmup_steps)
    if style == "constant":
        return max_lr
    if num_steps > decay_steps:
        return min_lr
    ratio = float(num_steps - warmup_steps) / float(decay_steps - warmup_steps)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("optimizer, training, warmup, decay", [
    # Sample-based (the Llama 3 8B example's options, scaled down): warm-up and decay given in samples.
    ({"lr_warmup_samples": 39, "lr_decay_samples": 1949}, {"train_samples": 1953}, 39, 1949),
    ({"lr_warmup_fraction": 0.01}, {"train_samples": 1000}, 10.0, 1000),
    # Iteration-based: Megatron converts to samples with the global batch (GPT-3 175B: a warm-up fraction).
    ({"lr_warmup_fraction": 0.001, "lr_decay_iters": 430}, {"train_iters": 500}, 0.001 * 430 * 24, 430 * 24),
    ({"lr_warmup_iters": 3}, {"train_iters": 50}, 3 * 24, 50 * 24),
])
@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_schedule_is_megatrons_in_samples(optimizer, training, warmup, decay, style):
    o = OptimizerConfig(lr=2e-3, min_lr=1e-4, lr_decay_style=style, **optimizer)
    t = TrainingConfig(global_batch_size=24, micro_batch_size=1, **training)
    schedule = LRSchedule.from_config(o, t, seq_length=64)
    assert (schedule.warmup, schedule.decay) == (pytest.approx(warmup), decay)
    for samples in [0, 1, 7, 24, 39, 40, 100, 999, 1000, 1001, 1949, 1950, 10320, 10321, 12000, 50000]:
        assert schedule.at(samples, o.lr, o.min_lr) == pytest.approx(
            megatron_lr(samples, o.lr, o.min_lr, warmup, decay, style), rel=1e-12, abs=1e-15)


def test_iteration_schedule_in_samples_equals_the_iteration_form():
    """With a constant batch, lr at k x G samples is the iteration schedule's lr at iteration k."""
    o = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4)
    schedule = LRSchedule.from_config(o, TrainingConfig(global_batch_size=8, train_iters=14), seq_length=64)
    assert [schedule.at(8 * k, o.lr, o.min_lr) for k in range(1, 20)] == [learning_rate(k, o, 14)
                                                                         for k in range(1, 20)]
