"""A linear layer's weight gradient, computed in its backward or deferred to a later W step (zero-bubble pipelines).

The backward of y = x A^T + b has two halves: dx = dy A, which the layer before it (and the pipeline stage before
this one) waits for, and dA = dy^T x, which nothing reads until the optimizer step. Zero-bubble schedules (Qi et al.
2023; Megatron's delay-wgrad does the same at its linear layers) compute dx in the B step and dA in a W step that
runs later, where the pipeline would otherwise idle.

``weight_gradient`` is the one function that computes a linear's weight gradient, whether in B or in W: the place
to hook in where it should change. Gradient-accumulation fusion (Megatron's) hooks in there: a weight whose
data-parallel engine gave it an accumulator has dA added straight into its main-gradient buffer (the engine's flat
fp32 buckets) by one matmul, and autograd sees no gradient for it, so there is no ``param.grad`` and no hook; the
accumulator also counts the weight as done for its bucket, whose overlapped reduction starts as before. FP8 would
hook in there too.

A :class:`WeightGradStore` is what a B step defers into. The pipeline engine runs each B step of a zero-bubble
schedule inside ``store.deferring(key)``; there a linear layer's backward (megalite.tensor_parallel.layers) hands the
store its weight and what dA needs (the input it saved and the gradient of its output) instead of computing dA, and
returns no gradient for the weight. The W step calls ``store.run(key)``: every deferred dA of that step is computed
and given to autograd as the gradient of its weight (``torch.autograd.backward`` on the weights themselves), so it
is added to ``.grad`` exactly as a backward would add it, and the parameters' post-accumulate hooks fire: the
data-parallel engine sums it into its bucket and, once the bucket's last W of the step is done, starts the
bucket's reduction. Weights that are not leaves, and backwards run outside ``deferring``, compute dA at once.

``attach_weight_grad_store(module, store)`` points every layer of ``module`` that can defer (those with a
``weight_grad_store`` attribute: the column- and row-parallel linears) at ``store``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterator, Optional

import torch


# The attribute a weight carries when its gradient goes straight into a main-gradient buffer (gradient-accumulation
# fusion): ``accumulate(grad_output_2d, input_2d)``, set by the data-parallel engine, which owns the buffer.
MAIN_GRAD_ACCUMULATOR = "accumulate_into_main_grad"


def weight_gradient(grad_output: torch.Tensor, total_input: torch.Tensor,
                    weight: torch.Tensor | None = None) -> torch.Tensor | None:
    """dA of y = x A^T over every token: grad_output [..., out] and the (sequence-gathered) input [..., in]. When
    ``weight`` accumulates into its main gradient (:data:`MAIN_GRAD_ACCUMULATOR`), dA is handed to it to be added
    there in one fused matmul, and None comes back: autograd gets no gradient for the weight."""
    grad_output = grad_output.reshape(-1, grad_output.shape[-1])
    total_input = total_input.reshape(-1, total_input.shape[-1])
    accumulate = getattr(weight, MAIN_GRAD_ACCUMULATOR, None)
    if accumulate is not None:
        accumulate(grad_output, total_input)
        return None
    return grad_output.t().matmul(total_input)


def accumulates_into_main_grad(weight: torch.Tensor) -> bool:
    return getattr(weight, MAIN_GRAD_ACCUMULATOR, None) is not None


class WeightGradStore:
    """Weight-gradient work deferred by B steps, keyed by step (e.g. (chunk, micro-batch)), run by W steps."""

    def __init__(self):
        self._collecting: Optional[Hashable] = None
        self._pending: dict[Hashable, list[tuple[torch.Tensor, Callable[..., torch.Tensor], tuple]]] = {}

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Inside the block, linear layers' weight gradients are deferred under ``key``."""
        if key in self._pending:
            raise RuntimeError(f"weight gradients of {key} are already deferred and not yet run")
        self._collecting, self._pending[key] = key, []
        try:
            yield
        finally:
            self._collecting = None

    def defers(self, weight: torch.Tensor) -> bool:
        """Whether a backward running now should leave ``weight``'s gradient to the store."""
        return self._collecting is not None and weight.is_leaf

    def defer(self, weight: torch.Tensor, compute: Callable[..., torch.Tensor], *args) -> None:
        """Queue ``compute(*args)`` as ``weight``'s gradient (only while ``defers(weight)``)."""
        self._pending[self._collecting].append((weight, compute, args))

    def run(self, key: Hashable) -> None:
        """Compute the gradients deferred under ``key`` and accumulate them into their weights (in the order the
        backward deferred them, the same on every tensor-parallel rank: the computation may gather over TP)."""
        work = self._pending.pop(key)
        grads = [(weight, compute(*args)) for weight, compute, args in work]
        grads = [(weight, grad) for weight, grad in grads if grad is not None]   # None: added to its main gradient
        if grads:
            torch.autograd.backward([weight for weight, _ in grads], [grad for _, grad in grads])

    def pending(self) -> list:
        """The keys still waiting for their W step."""
        return list(self._pending)

    def held_tensors(self) -> list[torch.Tensor]:
        """What the deferred work keeps alive (saved inputs, output gradients), for memory accounting."""
        return [t for work in self._pending.values() for _, _, args in work for t in args if torch.is_tensor(t)]


def attach_weight_grad_store(module: torch.nn.Module, store: Optional[WeightGradStore]) -> None:
    """Point every layer of ``module`` that can defer its weight gradient at ``store`` (None: never defer)."""
    for sub in module.modules():
        if hasattr(sub, "weight_grad_store"):
            sub.weight_grad_store = store
