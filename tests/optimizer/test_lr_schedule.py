from __future__ import annotations

import math

import pytest

from megalite.config import OptimizerConfig
from megalite.optimizer import learning_rate


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
