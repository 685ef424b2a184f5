"""GPT training samples from an indexed dataset: ``seq_length + 1`` tokens each, spanning documents as needed.

Three index arrays, built once per (index file, split, seq length, sample count, seed) and cached (see index_cache):

- ``doc_idx``: the split's documents in a shuffled order, one independent shuffle per epoch, as many epochs as it
  takes to hold ``num_samples * seq_length + 1`` tokens. Concatenated, they form the token stream.
- ``sample_idx``: where in that stream each sample starts (see index_builders): sample ``j`` is stream tokens
  ``[j * seq_length, (j + 1) * seq_length]``, so consecutive samples share one token and none is dropped.
- ``shuffle_idx``: a permutation of the samples, so a batch mixes distant parts of the stream.

Item ``i`` is sample ``shuffle_idx[i]``. Everything depends on the seed and the index file alone, never on the rank or
the layout, so every data-parallel layout reads the same samples in the same global order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megalite.data.errors import DataError
from megalite.data.index_builders import build_sample_idx
from megalite.data.index_cache import load_or_build
from megalite.data.indexed_dataset import IndexedDataset
from megalite.progress import Progress

_INDEX_VERSION = 1  # bump when the arrays' recipe changes, so old cache files are not reused
SPLIT_NAMES = ("train", "valid", "test")


def split_documents(num_documents: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """[first, last) document range of each split (Megatron's rounding: each boundary rounded, the total kept)."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


class GPTDataset:
    """``len(self)`` samples of documents ``[first, last)`` of ``indexed``; item ``i`` is a LongTensor of
    ``seq_length + 1`` tokens (inputs are the first ``seq_length``, labels the last ``seq_length``)."""

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], seq_length: int, num_samples: int,
                 seed: int, cache_dir: Path | None = None, split: str = "train", progress: bool = True):
        """``progress``: a bar on a terminal while the indices are built (megalite.progress)."""
        self.indexed, self.documents, self.seq_length, self.num_samples = indexed, documents, seq_length, num_samples
        self.split, self.progress = split, progress
        first, last = documents
        self.tokens_per_epoch = int(indexed.sizes[first:last].sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise DataError(f"{indexed.data_path}: the {split} split (documents {first} to {last}) has no tokens")
        description = {"kind": "GPTDataset", "version": _INDEX_VERSION, "index_md5": indexed.index_md5,
                       "documents": [first, last], "seq_length": seq_length, "num_samples": num_samples,
                       "seed": seed}
        arrays = load_or_build(cache_dir, f"{Path(indexed.prefix).name}-{split}", description,
                               ["doc_idx", "sample_idx", "shuffle_idx"], self._build_indices(seed))
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]

    @property
    def num_epochs(self) -> int:
        """Passes over the split's tokens needed for num_samples samples (the last one partial)."""
        needed = self.num_samples * self.seq_length + 1
        return -(-needed // self.tokens_per_epoch)

    def _build_indices(self, seed: int):
        def build() -> dict[str, np.ndarray]:
            first, last = self.documents
            # The bar counts the entries of the three arrays as they are made.
            entries = self.num_epochs * (last - first) + 2 * self.num_samples
            with Progress(entries, f"building the {self.split} sample index of {Path(self.indexed.prefix).name}",
                          "entries", enabled=self.progress) as bar:
                # RandomState's streams are frozen across numpy versions, so a cache built elsewhere stays valid.
                documents_rng = np.random.RandomState([seed % 2**32, 0])
                epochs = []
                for _ in range(self.num_epochs):
                    epochs.append(documents_rng.permutation(np.arange(first, last, dtype=np.int64)))
                    bar.update(last - first)
                doc_idx = np.concatenate(epochs)
                sample_idx = build_sample_idx(self.indexed.sizes, doc_idx, self.seq_length, self.num_samples)
                bar.update(self.num_samples)
                shuffle_idx = np.random.RandomState([seed % 2**32, 1]).permutation(self.num_samples).astype(np.int64)
                bar.update(self.num_samples)
            return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}
        return build

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, j: int) -> np.ndarray:
        """Sample ``j`` of the stream (before the shuffle): tokens ``[j * seq_length, (j + 1) * seq_length]``."""
        (k0, o0), (k1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        k0, o0, k1, o1 = int(k0), int(o0), int(k1), int(o1)
        if k0 == k1:
            return self.indexed.get(int(self.doc_idx[k0]), o0, o1 - o0 + 1)
        parts = [self.indexed.get(int(self.doc_idx[k0]), o0)]
        parts += [self.indexed.get(int(self.doc_idx[k])) for k in range(k0 + 1, k1)]
        parts.append(self.indexed.get(int(self.doc_idx[k1]), 0, o1 + 1))
        return np.concatenate(parts)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of a dataset of {self.num_samples}")
        return torch.from_numpy(self.sample(int(self.shuffle_idx[index])).astype(np.int64))
