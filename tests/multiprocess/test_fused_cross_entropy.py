"""The fused vocab-parallel cross entropy (per-shard statistics, two all-reduces, softmax recomputed in backward),
run through the kernels' torch ops, equals torch's cross entropy at TP=2 and TP=4, with padding that fills a whole
rank's slice at TP=4 (vocabulary 301 padded to 512: rank 3 holds columns 384-511, all padding).

fp32 on CPU; tolerance 1e-5 abs, as the other tensor-parallel layers.

And the kernels' verdict is agreed over the world: a kernel that fails its self-check on one rank runs as torch ops
on every rank (megalite.kernels.agreement; a stand-in extension on the CPU).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import parallel_state
from megalite.kernels import policy, self_check, torch_ops
from megalite.kernels.agreement import resolve
from megalite.kernels.policy import OPS, KernelPolicy
from megalite.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy

from ..helpers import fake_fused_extension
from .groups import layout

ATOL = 1e-5


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_vocab_parallel_cross_entropy(tp):
    vocab, padded = 301, 512
    torch.manual_seed(3)
    logits = (torch.randn(2, 5, padded) * 3).requires_grad_()
    target = torch.randint(vocab, (2, 5))
    grad_out = torch.rand(2, 5)
    expected = F.cross_entropy(logits[..., :vocab].transpose(1, 2), target, reduction="none")
    (expected * grad_out).sum().backward()
    with layout(tp):
        rank = parallel_state.get_tensor_model_parallel_rank()
        local = logits.detach().chunk(tp, dim=-1)[rank].clone().requires_grad_()
        loss = fused_vocab_parallel_cross_entropy(local, target, vocab, torch_ops)
        (loss * grad_out).sum().backward()
        torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(local.grad, logits.grad.chunk(tp, dim=-1)[rank], atol=ATOL, rtol=0)


@pytest.mark.usefixtures("fresh_extension_cache")   # tests/conftest.py: a verdict cache of this rank's own
def test_a_kernel_failing_its_self_check_on_one_rank_runs_as_torch_ops_on_every_rank(monkeypatch, capsys):
    extension = fake_fused_extension()
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: extension)
    if dist.get_rank() == 2:   # this rank's GPU computes RoPE wrong
        monkeypatch.setattr(self_check, "run_self_check", lambda *a: {"rope": "rope_forward bf16 8x5x64: error 1"})
    prepared = resolve(KernelPolicy("auto"), torch.device("cpu"))
    fake_cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cpu"))   # its kernels run on the CPU
    fused = [op for op in OPS if prepared.ops(op, fake_cuda) is extension]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, fused)
    assert every_rank == [["bias_gelu", "layernorm", "cross_entropy"]] * dist.get_world_size()
    expected = ["megalite: fused kernels rope run as torch ops on every rank: rank 2: rope_forward bf16 8x5x64: "
                "error 1"] if dist.get_rank() == 0 else []
    assert capsys.readouterr().err.splitlines() == expected
