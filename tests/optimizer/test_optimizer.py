"""The optimizer reports its own non-finite gradients, and the trainer names the rank that had them."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.optimizer.optimizer import fused_adamw
from megalite.training import Trainer
from megalite.training.hooks import StepHook
from megalite.training.stopping import TrainingError

from ..helpers import single_layout, tiny_config


def test_a_nan_gradient_is_reported_skips_the_step_and_stops_training_naming_the_rank():
    with single_layout():
        trainer = Trainer.on_registered_layout(tiny_config(data={"eval_interval": 0}), torch.device("cpu"))
        optimizer = trainer.optimizer
        assert not optimizer.has_nonfinite_grads()
        optimizer.pieces[-1].grad[0] = float("nan")
        assert optimizer.has_nonfinite_grads()
        step = optimizer.step(1e-3)
        assert step["skipped"] and math.isnan(step["grad_norm"])

        class NanAfterSync(StepHook):
            def after_grad_sync(self):
                optimizer.pieces[0].grad[0] = float("nan")
                return {}

        trainer.hooks.insert(0, NanAfterSync())
        with pytest.raises(TrainingError, match=r"iteration 1: gradient norm is nan .*rank\(s\) \[0\]"):
            trainer.train_step()


def test_adamw_is_fused_on_cuda_and_keeps_torchs_default_elsewhere():
    assert fused_adamw({"cuda"})
    assert not fused_adamw({"cpu"}) and not fused_adamw({"cpu", "cuda"}) and not fused_adamw(set())
    with single_layout():
        trainer = Trainer.on_registered_layout(tiny_config(data={"eval_interval": 0}), torch.device("cpu"))
        assert trainer.optimizer.inner.defaults["fused"] is None   # foreach, as before (False: the per-tensor loop)
