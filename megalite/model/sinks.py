"""Attention with a sink (--softmax-type off-by-one or learnable): each head's softmax has one more logit, the sink,
that takes probability without contributing a value, so a query may attend to (almost) nothing.

probs = softmax([q k^T / sqrt(d) + mask, sink])[..., :-1], then dropout and times v: Megatron's SoftmaxOne and Hugging
Face's GPT-OSS eager attention (which concatenate the sink to each row's scaled scores, softmax, drop it). The sink
is a raw logit, not scaled by 1/sqrt(d): off-by-one's is 0 (a +1 in the softmax denominator), learnable's one per
head (gpt-oss' ``sinks``).

torch's scaled_dot_product_attention has no such logit, and returns no log-sum-exp on every backend to rescale its
output by, so this core writes the softmax out (in fp32, like Megatron's unfused path): it materializes the
seq x keys probabilities, which selective recompute frees as for the fused softmax.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor,
                   mask: Optional[torch.Tensor], dropout: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
    """Attention of q [batch, heads, queries, d] over k, v [batch, key/value heads, keys, d] (grouped queries: query
    head i uses key/value head i // (heads / key/value heads)) with one ``sink`` logit per query head [heads];
    ``mask`` is boolean [queries, keys] or broadcastable to [batch, heads, queries, keys], True where allowed (None:
    every key); ``scale`` multiplies q k^T (default 1/sqrt(d)). Returns [batch, heads, queries, d] in v's dtype."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    batch, heads, queries, _ = scores.shape
    sinks = sink.float().view(1, heads, 1, 1).expand(batch, heads, queries, 1)
    probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1].to(v.dtype)
    return (F.dropout(probs, dropout) if dropout > 0 else probs) @ v
