"""Deterministic synthetic token sequences, chosen by global sample index alone.

Sample ``i`` is an arithmetic progression modulo the vocabulary whose start and stride are drawn from a generator
seeded by (seed, i): the next token is predictable from the previous two, so the loss visibly falls, and a sample is
the same whatever the layout, the micro-batch size or the rank that reads it.
"""

from __future__ import annotations

import sys

import torch

_MAX_STRIDE = 7


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int = sys.maxsize):
        self.vocab_size, self.seq_length, self.seed, self.num_samples = vocab_size, seq_length, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        """``seq_length + 1`` token ids (inputs are the first seq_length, labels the last seq_length)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of a dataset of {self.num_samples}")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=generator))
        stride = int(torch.randint(1, _MAX_STRIDE + 1, (1,), generator=generator))
        return (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
