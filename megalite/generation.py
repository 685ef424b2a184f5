"""Text continuation with a single-process model: greedy, or sampling with temperature, top-k and top-p.

No KV cache: each new token reruns the model on the whole context (cropped to the position table), which is plenty
for trying a checkpoint out and keeps the model code free of inference-only paths.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


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
def generate(model: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], max_new_tokens: int,
             max_positions: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eod: Optional[int] = None, seed: int = 0) -> list[int]:
    """Token ids continuing ``prompt`` (at most ``max_new_tokens``, stopping after ``eod``); ``model`` maps token
    ids [1, seq] to logits [1, seq, vocab]."""
    if not prompt:
        raise ValueError("the prompt has no tokens")
    generator = torch.Generator().manual_seed(seed)
    tokens, new = list(prompt), []
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-max_positions:]])
        token = next_token(model(context)[0, -1], temperature, top_k, top_p, generator)
        tokens.append(token)
        new.append(token)
        if token == eod:
            break
    return new
