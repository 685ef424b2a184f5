"""Muon's update on one matrix against a reference written here, and which parameters it steps in a GPT."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megalite import parallel_state
from megalite.optimizer.muon import Muon, MuonSettings
from megalite.tensor_parallel.partition import Partition
from megalite.training import Trainer

from ..helpers import single_layout, tiny_config

COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # Keller Jordan's quintic, as published


def reference_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The published iteration: X <- aX + (bA + cA^2)X, A = XX^T, on the wide orientation, from X = G/||G||_F."""
    a, b, c = COEFFICIENTS
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


@pytest.mark.parametrize("shape, nesterov", [((24, 40), False), ((48, 16), True)])
def test_two_steps_on_one_matrix_equal_the_reference(shape, nesterov):
    torch.manual_seed(0)
    weight = torch.randn(shape)
    grads = [torch.randn(shape), torch.randn(shape)]
    lr, decay, momentum = 0.02, 0.1, 0.9
    param = torch.nn.Parameter(weight.clone())
    piece = SimpleNamespace(param=param, main=param, grad=None)
    muon = Muon([piece], engine=None, settings=MuonSettings(momentum=momentum, nesterov=nesterov), weight_decay=decay)

    expected, buffer = weight.clone(), torch.zeros(shape)
    for grad in grads:
        piece.grad = grad
        muon.step(lr)
        buffer = momentum * buffer + (1 - momentum) * grad
        update = (1 - momentum) * grad + momentum * buffer if nesterov else buffer
        scale = 0.2 * math.sqrt(max(shape))   # Moonlight: the RMS of an AdamW update
        expected = expected * (1 - lr * decay) - lr * scale * reference_newton_schulz(update)
    assert torch.allclose(param.detach(), expected, rtol=0, atol=1e-5), (param - expected).abs().max()
    # Newton-Schulz's promise: singular values near 1 (the quintic leaves them in about [0.7, 1.2]).
    singular = torch.linalg.svdvals(reference_newton_schulz(grads[0]))
    assert 0.6 < singular.min() and singular.max() < 1.25


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon came in torch 2.9")
def test_one_step_matches_torch_muon():
    """torch.optim.Muon (bf16 Newton-Schulz) with its AdamW-matched scale: equal up to bf16's rounding."""
    torch.manual_seed(1)
    weight, grad = torch.randn(32, 48), torch.randn(32, 48)
    ours = torch.nn.Parameter(weight.clone())
    muon = Muon([SimpleNamespace(param=ours, main=ours, grad=grad)], None, MuonSettings(nesterov=True), 0.1)
    muon.step(0.05)
    theirs = torch.nn.Parameter(weight.clone())
    theirs.grad = grad
    torch.optim.Muon([theirs], lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True,
                     adjust_lr_fn="match_rms_adamw").step()
    step = (weight - theirs.detach()).abs().max()
    assert (ours - theirs).abs().max() < 0.02 * step


def test_hidden_matrices_take_muon_and_the_rest_adamw():
    cfg = tiny_config(model={"position_embedding_type": "learned_absolute"}, optimizer={"optimizer": "muon"},
                      training={"train_iters": 1})
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, torch.device("cpu"))
        names = {id(p): n for n, p in trainer.canonical_named_parameters()}
        optimizer = trainer.optimizer
        muon = sorted(names[id(p.param)] for p in optimizer.muon.pieces)
        of_main = {id(p.main): names[id(p.param)] for p in optimizer.pieces}
        adam = [of_main[id(p)] for group in optimizer.inner.param_groups for p in group["params"]]
    assert muon == sorted(f"layers.{i}.{m}.weight" for i in range(2)
                          for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                                    "mlp.linear_fc2"))
    assert "embedding.word.weight" in str(adam) and "embedding.position.weight" in str(adam)
    assert all("weight" not in n or "norm" in n or "embedding" in n or "output" in n for n in adam), adam


def test_blockwise_equals_the_whole_matrix_only_without_tensor_parallelism():
    """--muon-tp-mode blockwise orthogonalizes a TP shard alone, scaled by the shard's shape: at TP=2 not the
    single process's update (the duplicated mode's, this rank's rows of the whole matrix's), at TP=1 that update."""
    torch.manual_seed(3)
    whole = torch.randn(48, 32)
    scale = 0.2 * math.sqrt(48)   # spectral: sqrt(max(m, n)) of the whole matrix, with the 0.2 AdamW match
    single = reference_newton_schulz(whole) * scale

    def param(rows):
        p = torch.nn.Parameter(torch.empty(rows, 32))
        p.partition, p.full_shape = Partition(dim=0), (48, 32)
        return p

    blockwise, duplicated_rows = MuonSettings(tp_mode="blockwise"), single[24:]
    with parallel_state.simulated_layout(tp=2, tp_rank=1):
        shard = whole[24:]
        ours = blockwise.orthogonalize(shard, param(24))
    assert torch.allclose(ours, reference_newton_schulz(shard) * 0.2 * math.sqrt(32), atol=1e-5)
    assert (ours - duplicated_rows).abs().max() > 0.1 * duplicated_rows.abs().max()
    with parallel_state.simulated_layout(tp=1):
        assert torch.allclose(blockwise.orthogonalize(whole, param(48)), single, atol=1e-5)
