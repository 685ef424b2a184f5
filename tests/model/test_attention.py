"""Sliding-window attention (--window-size LEFT,0): each query attends to itself and the LEFT tokens before it, the
same as a softmax over explicitly masked scores written out here, with grouped queries, packed documents (the
window and the documents' mask together), selective recompute and the fused-softmax policy; a window as long as
the sequence changes nothing. fp32, within 1e-5 of the largest output.

Attention sinks (--softmax-type off-by-one, learnable): the same naive softmax with the sink logit concatenated to
each row (dropped after the softmax), with and without a window, grouped queries, recompute and packed documents;
the learnable sink's gradient is autograd's through that naive softmax, and gpt-oss' own attention in transformers
(GptOssAttention, eager, its ``sinks``) gives the same output for the same weights."""

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


def _naive(attention: SelfAttention, x: torch.Tensor, window: int | None, documents=None,
           sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the scores of the allowed keys, one query at a time: key j for query i when j <= i, i - j <=
    window, and (packed documents) both in the same document; with a ``sink`` [heads], head h's sink logit is
    concatenated to the scores before the softmax and its probability dropped after."""
    q, k, v = attention.linear_qkv(x).split([64, 32, 32], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, 16)) for t in (q, k, v))   # [batch, seq, heads, 16]
    out = torch.zeros_like(q)
    for b in range(x.shape[0]):
        for h in range(4):
            for i in range(SEQ):
                keys = [j for j in range(i + 1) if (window is None or i - j <= window)
                        and (documents is None or documents[b, i] == documents[b, j])]
                scores = torch.stack([q[b, i, h] @ k[b, j, h // 2] for j in keys]) / math.sqrt(16)
                if sink is None:
                    out[b, i, h] = torch.softmax(scores, 0) @ v[b, keys, h // 2]
                else:
                    out[b, i, h] = torch.softmax(torch.cat([scores, sink[h:h + 1]]), 0)[:-1] @ v[b, keys, h // 2]
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


def _sink_of(attention: SelfAttention) -> torch.Tensor:
    return attention.softmax_offset if attention.softmax_type == "learnable" else torch.zeros(4)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("window", [3, None], ids=["3-before", "none"])
@pytest.mark.parametrize("options", [{}, {"recompute_granularity": "selective"}], ids=["plain", "recompute"])
def test_sink_attention_is_the_naive_softmax_with_the_sink_logit(softmax_type, window, options):
    attention = _attention(window, softmax_type=softmax_type, **options).train(bool(options))
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(3))
    out = attention(x)
    expected = _naive(attention, x, window, sink=_sink_of(attention))
    assert_close_to_scale(out.detach(), expected.detach())
    assert (out - _naive(attention, x, window)).abs().max() > 1e-2   # the sink changes the output
    if softmax_type == "learnable":   # its gradient: autograd's through the naive softmax
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        grad, = torch.autograd.grad((out * weights).sum(), attention.softmax_offset)
        expected_grad, = torch.autograd.grad((expected * weights).sum(), attention.softmax_offset)
        assert_close_to_scale(grad, expected_grad)


def test_sinks_over_packed_documents():
    attention = _attention(None, softmax_type="learnable")
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(5))
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    shard = shard_sequence(SEQ, x.device, documents=documents)
    with torch.no_grad():
        assert_close_to_scale(attention(x, shard), _naive(attention, x, None, documents, attention.softmax_offset))


def test_a_learnable_sink_is_drawn_like_megatrons_per_head_offset():
    """One logit per head, canonical [heads], split over TP with the heads, drawn from N(0, init_method_std)."""
    attention = _attention(None, softmax_type="learnable")
    param = attention.softmax_offset
    assert param.shape == (4,) and param.full_shape == (4,) and param.partition.dim == 0
    full = torch.empty(4000)
    param.init_fn(full, torch.Generator().manual_seed(0))
    assert abs(full.std().item() - 0.02) < 2e-3   # tiny_config's --init-method-std
    assert not hasattr(_attention(None, softmax_type="off-by-one"), "softmax_offset")


@pytest.mark.parametrize("window", [3, None], ids=["3-before", "none"])
def test_learnable_sinks_match_transformers_gpt_oss_attention(window):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss
    attention = _attention(window, softmax_type="learnable", disable_bias_linear=True)
    config = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_hidden_layers=1, attention_bias=False,
                                       sliding_window=None if window is None else window + 1,
                                       layer_types=["sliding_attention" if window else "full_attention"])
    config._attn_implementation = "eager"
    theirs = gpt_oss.GptOssAttention(config, 0).eval()
    q, k, v = attention.linear_qkv.weight.split([64, 32, 32])
    with torch.no_grad():
        for linear, weight in zip((theirs.q_proj, theirs.k_proj, theirs.v_proj, theirs.o_proj),
                                  (q, k, v, attention.linear_proj.weight)):
            linear.weight.copy_(weight)
        theirs.sinks.copy_(attention.softmax_offset)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(6))
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if window is not None:   # the query and the window before it (eager attention takes the mask it is given)
        allowed = allowed.triu(-window)
    mask = torch.zeros(SEQ, SEQ).masked_fill(~allowed, float("-inf"))
    identity = (torch.ones(2, SEQ, 8), torch.zeros(2, SEQ, 8))   # cos, sin: no rotation (megalite's has no rope here)
    with torch.no_grad():
        out, _ = theirs(x, identity, mask)
        assert_close_to_scale(attention(x), out)
