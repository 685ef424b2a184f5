"""Text continuation with a single-process model: greedy, or sampling with temperature, top-k and top-p.

With the KV cache (the default) the prompt runs once and each new token costs one position (megalite.model.kv_cache);
without it each new token reruns the model on the whole context. Both give the same tokens. A context longer than the
position table is cropped to its last ``max_positions`` tokens, as without the cache: the cache then starts again
from the cropped context.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megalite.model import KVCache


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: Optional[torch.Generator] = None) -> int:
    """The next token id from the last position's logits [vocab]: the argmax when ``temperature`` is 0, else a sample
    from softmax(logits / temperature) restricted to the ``top_k`` most likely tokens (0: all) and to the smallest
    set whose probability reaches ``top_p`` (nucleus sampling)."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the tokens before it already reach top_p (the most likely one always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(model: Callable[..., torch.Tensor], prompt: Sequence[int], max_new_tokens: int, max_positions: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, eod: Optional[int] = None, seed: int = 0,
             use_cache: bool = True, device: torch.device | str = "cpu") -> list[int]:
    """Token ids continuing ``prompt`` (at most ``max_new_tokens``, stopping after ``eod``); ``model(tokens,
    cache=None)`` maps token ids [1, seq] to logits [1, seq, vocab], the ids continuing the cached ones when it is
    given a :class:`KVCache`."""
    if not prompt:
        raise ValueError("the prompt has no tokens")
    generator = torch.Generator().manual_seed(seed)
    tokens, new = [int(t) for t in prompt], []
    cache, pending = None, tokens   # pending: the tokens the cache does not hold yet
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model(torch.tensor([tokens[-max_positions:]], device=device))
        else:
            if cache is None or cache.length + len(pending) > cache.max_length:   # (again) from the cropped context
                pending = tokens[-max_positions:]
                cache = KVCache(min(max_positions, len(pending) + max_new_tokens - len(new)))
            logits = model(torch.tensor([pending], device=device), cache=cache)
        token = next_token(logits[0, -1], temperature, top_k, top_p, generator)
        tokens.append(token)
        new.append(token)
        pending = [token]
        if token == eod:
            break
    return new
