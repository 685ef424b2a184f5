"""The fused vocab-parallel cross entropy (per-shard statistics, two all-reduces, softmax recomputed in backward),
run through the kernels' torch ops, equals torch's cross entropy at TP=2 and TP=4, with padding that fills a whole
rank's slice at TP=4 (vocabulary 301 padded to 512: rank 3 holds columns 384-511, all padding).

fp32 on CPU; tolerance 1e-5 abs, as the other tensor-parallel layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite import parallel_state
from megalite.kernels import torch_ops
from megalite.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy

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
