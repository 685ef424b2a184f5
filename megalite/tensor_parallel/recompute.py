"""Activation recompute: run a function without keeping its intermediate activations, run it again in backward.

``recompute(function, rng, *inputs)`` keeps only ``inputs`` and the random-number states. The forward runs under
``no_grad``. Backward sets the default and the tensor-parallel dropout streams back to what they were before the
forward, reruns ``function`` with grad enabled, backpropagates through it, and then restores the streams to where
the rest of the schedule had taken them (with 1F1B, forwards of later micro-batches run in between). The recomputed
forward thus draws the same dropout masks as the first one and the gradients are exactly those without recompute.

This is Megatron's CheckpointFunction ("reentrant": backward calls autograd itself). torch.utils.checkpoint restores
the default generator only, not a tracked tensor-parallel stream, which is why megalite has its own.

:class:`DiscardedOutput` keeps not even the output (Megatron's CheckpointWithoutOutput, for --recompute-modules
layernorm, moe_act, mla_up_proj): the module that consumes the output saves it for its own backward, so freeing the
output's storage once that module has run leaves nothing of it; when the gradient reaches the consuming module's
output, a hook recomputes the output into the same storage, before the consumer's backward reads it.
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


class _DiscardableOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner, *inputs):
        # The inputs are saved as autograd saves tensors (so saved-tensor hooks see them); the owner reads them back
        # in its refill hook, which runs before this node's backward (the reference cycle is cut there).
        ctx.owner, owner.ctx, owner.states = owner, ctx, _capture(owner.rng)
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return owner.function(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        owner = ctx.owner
        outputs, inputs = owner.recomputed
        owner.recomputed = owner.ctx = None
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(x.grad if x.requires_grad else None for x in inputs))


class DiscardedOutput:
    """``function(*inputs)`` (a tensor or a tuple of them) whose outputs are freed once their consumer has run and
    recomputed when the gradient reaches the consumer (see the module doc): ``y = d.run(...)``, ``z = consumer(y)``,
    ``d.discard(z)``. Every output must be a fresh tensor (no view of an input)."""

    def __init__(self, function: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
                 rng: Optional[TensorParallelRNG]):
        self.function, self.rng = function, rng
        self.ctx = self.states = self.recomputed = self.outputs = None

    def run(self, *inputs: torch.Tensor):
        outputs = _DiscardableOutput.apply(self, *inputs)
        self.outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        return outputs

    def discard(self, consumer_output: torch.Tensor) -> None:
        """Free the outputs (the consumer has saved what it needs) and recompute them when ``consumer_output``'s
        gradient arrives."""
        if not consumer_output.requires_grad:   # nothing will come back for it
            return
        consumer_output.register_hook(self._refill)
        for output in self.outputs:
            output.untyped_storage().resize_(0)

    def _refill(self, grad: torch.Tensor) -> None:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in self.ctx.saved_tensors]
        now = _capture(self.rng)
        _restore(self.rng, self.states)
        try:
            with torch.enable_grad():
                outputs = self.function(*inputs)
        finally:
            _restore(self.rng, now)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        for kept, recomputed in zip(self.outputs, outputs):
            storage = kept.untyped_storage()
            storage.resize_(recomputed.untyped_storage().size())
            storage.copy_(recomputed.untyped_storage())   # in place, version unchanged: the consumer saved ``kept``
        self.recomputed = (outputs, inputs)
