"""Recompute replays both dropout streams, gives the gradients of the plain run, and leaves the streams where the
rest of the schedule took them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.tensor_parallel import TensorParallelRNG, recompute


def _block(rng: TensorParallelRNG, weight: torch.Tensor):
    def function(x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(x @ weight, p=0.5)           # the default stream
        with rng.fork():
            y = F.dropout(torch.tanh(y), p=0.5)    # the tensor-parallel stream
        return y @ weight.t()
    return function


def _run(use_recompute: bool):
    rng = TensorParallelRNG(seed=5, tp_rank=1, pp_rank=0, device=torch.device("cpu"))
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    function = _block(rng, weight)
    y = recompute(function, rng, x) if use_recompute else function(x)
    # Between forward and backward other micro-batches draw from both streams (1F1B): backward must not disturb them.
    F.dropout(torch.ones(16), 0.5)
    with rng.fork():
        F.dropout(torch.ones(16), 0.5)
    after_forward = (torch.get_rng_state(), rng.get_states()[1])
    (y * torch.arange(8.0)).sum().backward()
    after_backward = (torch.get_rng_state(), rng.get_states()[1])
    return y.detach(), x.grad, weight.grad, after_forward, after_backward


def test_recompute_gives_identical_outputs_gradients_and_streams():
    plain, recomputed = _run(False), _run(True)
    for a, b in zip(plain[:3], recomputed[:3]):
        assert torch.equal(a, b)
    _, _, _, after_forward, after_backward = recomputed
    assert all(torch.equal(a, b) for a, b in zip(after_forward, after_backward))


def test_recompute_keeps_only_the_inputs():
    rng = TensorParallelRNG(seed=5, tp_rank=0, pp_rank=0, device=torch.device("cpu"))
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        recompute(_block(rng, weight), rng, x)
    assert len(saved) == 1 and saved[0] is x
