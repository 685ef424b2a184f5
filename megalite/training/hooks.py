"""The parts of a training step that belong to some layers of the model rather than to the loop: registered on the
trainer (``Trainer.hooks``) and called, in order of registration, at these points of every step."""

from __future__ import annotations

from megalite import parallel_state
from megalite.tensor_parallel import update_delayed_scales


class StepHook:
    def before_forward_backward(self, loss_scale: float, global_batch_size: int) -> None:
        """Before the passes over a global batch of ``global_batch_size`` samples; fp16's ``loss_scale`` (else 1)."""

    def after_grad_sync(self) -> dict:
        """Once the gradients are summed over DP: metrics for the iteration's record."""
        return {}

    def before_optimizer_step(self) -> None:
        pass


class DelayedFp8Scales(StepHook):
    """FP8 delayed scaling: this step's amaxes, maxed over the ranks holding each layer (TP, DP x CP), give the next
    scales; before the optimizer step, whose FP8 parameter gather quantizes the weights with them."""

    def __init__(self, histories: list):
        self.histories, self.groups = histories, (parallel_state.get_tensor_model_parallel_group(),
                                                  parallel_state.get_data_parallel_group(with_context_parallel=True))

    def before_optimizer_step(self) -> None:
        update_delayed_scales(self.histories, self.groups)
