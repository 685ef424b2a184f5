"""Activation recompute: run a function without keeping its intermediate activations, run it again in backward.

``recompute(function, rng, *inputs)`` keeps only ``inputs`` and the random-number states. The forward runs under
``no_grad``. Backward sets the default and the tensor-parallel dropout streams back to what they were before the
forward, reruns ``function`` with grad enabled, backpropagates through it, and then restores the streams to where
the rest of the schedule had taken them (with 1F1B, forwards of later micro-batches run in between). The recomputed
forward thus draws the same dropout masks as the first one and the gradients are exactly those without recompute.

This is Megatron's CheckpointFunction ("reentrant": backward calls autograd itself). torch.utils.checkpoint restores
the default generator only, not a tracked tensor-parallel stream, which is why megalite has its own.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megalite.tensor_parallel.random import TensorParallelRNG

def _capture(rng: Optional[TensorParallelRNG]) -> tuple:
    if rng is not None:
        return rng.get_states()
    # No tracker (dropout off, or a model built without one): the default generators are all there is.
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore(rng: Optional[TensorParallelRNG], states: tuple) -> None:
    if rng is not None:
        rng.set_states(states)
        return
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, rng, *inputs):
        ctx.function, ctx.rng = function, rng
        ctx.states = _capture(rng)
        with torch.no_grad():
            outputs = function(*inputs)
        ctx.save_for_backward(*inputs)
        ctx.single = torch.is_tensor(outputs)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        now = _capture(ctx.rng)
        _restore(ctx.rng, ctx.states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*inputs)
        finally:
            _restore(ctx.rng, now)
        outputs = (outputs,) if ctx.single else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


def recompute(function: Callable[..., torch.Tensor], rng: Optional[TensorParallelRNG],
              *inputs: torch.Tensor) -> torch.Tensor:
    """``function(*inputs)``, keeping only ``inputs`` for backward, which recomputes the rest (see the module doc)."""
    return _Recompute.apply(function, rng, *inputs)
