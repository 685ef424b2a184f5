"""Step hooks: what a registered hook is called with, in which order, and where its metrics go."""

from __future__ import annotations

import torch

from megalite.training import Trainer
from megalite.training.hooks import DelayedFp8Scales, StepHook
from megalite.training.moe_statistics import MoEStatistics

from ..helpers import single_layout, tiny_config


class Recording(StepHook):
    def __init__(self, trainer):
        self.trainer, self.calls = trainer, []

    def before_forward_backward(self, loss_scale, global_batch_size):
        self.calls.append(("before_forward_backward", loss_scale, global_batch_size))

    def after_grad_sync(self):
        grads = [p.main_grad for p in self.trainer.model.parameters()]
        self.calls.append(("after_grad_sync", any(bool(g.abs().sum() > 0) for g in grads)))
        return {"recorded": len(self.calls)}

    def before_optimizer_step(self):
        self.calls.append(("before_optimizer_step",))


def test_a_registered_hook_runs_at_its_points_of_each_step_and_adds_its_metrics():
    with single_layout():
        trainer = Trainer.on_registered_layout(tiny_config(data={"eval_interval": 0}, training={"train_iters": 2}),
                                               torch.device("cpu"))
        assert [type(h) for h in trainer.hooks] == [MoEStatistics, DelayedFp8Scales]   # registered by the setup
        hook = Recording(trainer)
        trainer.hooks.append(hook)
        records = trainer.train()
    step = [("before_forward_backward", 1.0, 8), ("after_grad_sync", True), ("before_optimizer_step",)]
    assert hook.calls == step + step
    assert [r["recorded"] for r in records] == [2, 5]
