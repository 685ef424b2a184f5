"""A key/value cache for generation: each layer keeps the keys and values of the tokens seen so far, so a new token
costs one position's work instead of rerunning the whole context.

``KVCache(max_length)`` goes through the model's forward (``GPTModel(tokens, cache=cache)``): the first call (the
prompt) fills positions 0 .. n-1, each later call appends its tokens after them; rotary and learned positions start
at ``cache.length``. Buffers are allocated on first use per layer, [batch, key/value heads, max_length, head dim] in
the keys' dtype and device. Inference only (no dropout, no autograd through the cache), at any tensor-parallel size:
each rank caches its own heads. Attention over the cache runs through scaled_dot_product_attention whatever the
kernel policy (the fused masked softmax is square: every query sees only the keys up to its own position). A layer
with a sliding window (--window-size) attends over the last window + 1 cached positions only; the cache still keeps
every position (the buffers are sized by ``max_length`` either way). A layer with attention sinks (--softmax-type)
attends through megalite.model.sinks' softmax instead, its sink in every row. A multi-latent attention layer
(megalite.model.latent_attention) caches its compressed latent and rotated rotary key, [batch, 1, max_length, rank]
and [batch, 1, max_length, rope channels], not per-head keys and values: DeepSeek-V3's 512 + 64 channels a token
instead of 128 heads x (192 + 128).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megalite.model.sinks import sink_attention


def causal_mask(queries: int, keys: int, window: Optional[int], device: torch.device) -> Optional[torch.Tensor]:
    """Which of ``keys`` positions each query may attend to, the queries being the last ``queries`` of them: a
    boolean [queries, keys] mask (True where allowed), the keys up to the query's own position and, with a sliding
    ``window``, not before position - window (the query and the ``window`` tokens before it, Hugging Face's
    ``sliding_window`` window + 1). None where every query sees every key."""
    offset = keys - queries   # query i is at position offset + i
    if queries == 1 and (window is None or keys <= window + 1):
        return None
    mask = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(offset)
    return mask if window is None else mask.triu(offset - window)


class KVCache:
    def __init__(self, max_length: int):
        self.max_length = max_length
        self.length = 0   # tokens cached so far: the position of the next token
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def store(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``index``'s new keys and values [batch, heads, new, d] after the cached ones; return all of
        them, [batch, heads, length + new, d]. (Multi-latent attention stores its latent and rotary key instead,
        [batch, 1, new, rank] and [batch, 1, new, rope channels]: any two tensors of the same positions.)"""
        start, end = self.length, self.length + k.shape[-2]
        if end > self.max_length:
            raise ValueError(f"the KV cache holds {self.max_length} positions, {end} asked for")
        if index not in self._buffers:
            self._buffers[index] = tuple(t.new_empty((*t.shape[:-2], self.max_length, t.shape[-1])) for t in (k, v))
        keys, values = self._buffers[index]
        keys[..., start:end, :] = k
        values[..., start:end, :] = v
        return keys[..., :end, :], values[..., :end, :]

    def advance(self, tokens: int) -> None:
        """After a forward pass over ``tokens`` new positions (every layer has stored them)."""
        self.length += tokens


class LayerCache:
    """One layer's view of a :class:`KVCache`."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    @property
    def offset(self) -> int:
        return self.cache.length

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: Optional[int] = None, sink: Optional[torch.Tensor] = None,
               scale: Optional[float] = None) -> torch.Tensor:
        """Store the new k and v, then causal attention of the new queries [batch, heads, new, d] (the last
        positions) over the cached keys, with a sliding ``window`` over its last ``window`` + 1 positions only and,
        given one, each head's ``sink`` logit [heads] in its softmax, the scores scaled by ``scale`` (default
        1/sqrt(d)); heads merged: [batch, new, heads x d]."""
        keys, values = self.cache.store(self.index, k, v)
        return self.attend_stored(q, keys, values, window, sink, scale)

    def attend_stored(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      window: Optional[int] = None, sink: Optional[torch.Tensor] = None,
                      scale: Optional[float] = None) -> torch.Tensor:
        """:meth:`attend` over keys and values of every cached position, the new ones included (multi-latent
        attention's, up-projected from the stored latent)."""
        new, total = q.shape[-2], keys.shape[-2]
        if window is not None:   # keys before the first new query's window are seen by no query
            first = max(total - new - window, 0)
            keys, values = keys[..., first:, :], values[..., first:, :]
        mask = causal_mask(new, keys.shape[-2], window, q.device)
        if sink is not None:
            context = sink_attention(q, keys, values, sink, mask, scale=scale)
        else:
            context = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                     enable_gqa=keys.shape[1] != q.shape[1])
        batch, heads, _, head_dim = context.shape
        return context.transpose(1, 2).reshape(batch, new, heads * head_dim)
