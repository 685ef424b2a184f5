"""A weighted mixture of datasets (``--data-path 0.3 A 0.7 B``): item ``i`` is item ``dataset_sample_index[i]`` of
dataset ``dataset_index[i]``.

The blending index (see index_builders) interleaves the datasets so that every prefix of the blend, hence every
global batch, holds each dataset's share give or take one sample. It is computed before the datasets are built, so
each of them is asked for exactly as many samples as the blend takes from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from megalite.data.index_builders import build_blending_indices
from megalite.data.index_cache import load_or_build

_INDEX_VERSION = 1


def blending_indices(weights: Sequence[float], size: int, cache_dir: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for ``size`` samples, normalized weights, cached in ``cache_dir``."""
    total = float(sum(weights))
    normalized = [float(w) / total for w in weights]
    description = {"kind": "BlendedDataset", "version": _INDEX_VERSION, "weights": normalized, "size": size}

    def build() -> dict[str, np.ndarray]:
        dataset_index, dataset_sample_index = build_blending_indices(normalized, size)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    arrays = load_or_build(cache_dir, "blend", description, ["dataset_index", "dataset_sample_index"], build)
    return arrays["dataset_index"], arrays["dataset_sample_index"]


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(self, weights: Sequence[float], size: int, make_dataset: Callable[[int, int], object],
                 cache_dir: Path | None = None):
        """``make_dataset(d, n)`` builds dataset ``d`` with ``n`` samples (only for datasets the blend uses)."""
        self.weights, self.size = list(weights), size
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, size, cache_dir)
        counts = np.bincount(np.asarray(self.dataset_index, dtype=np.int64), minlength=len(self.weights))
        self.datasets = [make_dataset(d, int(n)) if n else None for d, n in enumerate(counts)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} of a dataset of {self.size}")
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]
