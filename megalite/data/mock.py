"""Deterministic synthetic token sequences, chosen by global sample index alone.

Sample ``i`` is an arithmetic progression modulo the vocabulary whose start and stride are drawn from a generator
seeded by (seed, i): the next token is predictable from the previous two, so the loss visibly falls, and a sample is
the same whatever the layout, the micro-batch size or the rank that reads it.
"""

from __future__ import annotations

import torch

_MAX_STRIDE = 7


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __getitem__(self, index: int) -> torch.Tensor:
        """``seq_length + 1`` token ids (inputs are the first seq_length, labels the last seq_length)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=generator))
        stride = int(torch.randint(1, _MAX_STRIDE + 1, (1,), generator=generator))
        return (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
