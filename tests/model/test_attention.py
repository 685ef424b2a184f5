"""Sliding-window attention (--window-size LEFT,0): each query attends to itself and the LEFT tokens before it, the
same as a softmax over explicitly masked scores written out here, with grouped queries, packed documents (the
window and the documents' mask together), selective recompute and the fused-softmax policy; a window as long as
the sequence changes nothing. fp32, within 1e-5 of the largest output."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.kernels import KernelPolicy
from megalite.model.attention import SelfAttention
from megalite.model.context_parallel import shard_sequence
from megalite.tensor_parallel import TensorParallelRNG

from ..helpers import assert_close_to_scale, tiny_config

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py

SEQ = 12


def _attention(window, **options) -> SelfAttention:
    cfg = tiny_config(model={"group_query_attention": True, "num_query_groups": 2, **options}).model
    torch.manual_seed(0)
    rng = TensorParallelRNG(0, 0, 0, torch.device("cpu"))
    attention = SelfAttention(cfg, rng, kernels=KernelPolicy("on"), window=window).eval()
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attention


def _naive(attention: SelfAttention, x: torch.Tensor, window: int | None, documents=None) -> torch.Tensor:
    """softmax over the scores of the allowed keys, one query at a time: key j for query i when j <= i, i - j <=
    window, and (packed documents) both in the same document."""
    q, k, v = attention.linear_qkv(x).split([64, 32, 32], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, 16)) for t in (q, k, v))   # [batch, seq, heads, 16]
    out = torch.zeros_like(q)
    for b in range(x.shape[0]):
        for h in range(4):
            for i in range(SEQ):
                keys = [j for j in range(i + 1) if (window is None or i - j <= window)
                        and (documents is None or documents[b, i] == documents[b, j])]
                scores = torch.stack([q[b, i, h] @ k[b, j, h // 2] for j in keys]) / math.sqrt(16)
                out[b, i, h] = torch.softmax(scores, 0) @ v[b, keys, h // 2]
    return attention.linear_proj(out.flatten(-2))


@pytest.mark.parametrize("window", [0, 3, 11, None], ids=["itself-only", "3-before", "whole-sequence", "none"])
@pytest.mark.parametrize("options", [{}, {"recompute_granularity": "selective"}], ids=["plain", "recompute"])
def test_windowed_attention_is_the_explicitly_masked_softmax(window, options):
    attention = _attention(window, **options).train(bool(options))   # recompute reruns the core in training only
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    assert_close_to_scale(attention(x).detach(), _naive(attention, x, window).detach())


def test_a_window_over_packed_documents_masks_both():
    attention = _attention(2)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(2))
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    shard = shard_sequence(SEQ, x.device, documents=documents)
    with torch.no_grad():
        assert_close_to_scale(attention(x, shard), _naive(attention, x, 2, documents))
