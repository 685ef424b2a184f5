"""The sample index of a GPT dataset and the blending index of a blend: C++ (``csrc/data_index_builders.cpp``, built
on first use) with numpy twins that give the same arrays where the extension cannot be built.

Sample index: ``sample_idx[j] = (k, offset)`` says that token ``j * seq_length`` of the stream formed by documents
``doc_idx[0], doc_idx[1], ...`` is token ``offset`` of document ``doc_idx[k]``, where ``k`` is the one position whose
document holds that token (empty documents are never chosen). Sample ``j`` runs from ``sample_idx[j]`` through
``sample_idx[j + 1]`` inclusive, ``seq_length + 1`` tokens; neighbouring samples share one token (the last label of
one is the first input of the next), so every token of the stream is predicted exactly once.

Blending index: sample ``i`` of a blend comes from the dataset furthest behind its weight,
``argmax_d weights[d] * (i + 1) - taken[d]`` (lowest ``d`` on ties), so after any prefix of ``n`` samples each dataset
has given ``round(weight * n)`` of them give or take one. ``dataset_sample_index[i]`` counts that dataset's earlier
samples.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import numpy as np

from megalite.extensions import load_extension

EXTENSION_NAME = "megalite_data_index_builders"
EXTENSION_SOURCES = ["data_index_builders.cpp"]


def extension() -> types.ModuleType | None:
    """The compiled builders, or None (no compiler, or MEGALITE_DISABLE_EXTENSIONS=1): then numpy does it."""
    return load_extension(EXTENSION_NAME, EXTENSION_SOURCES)


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int,
                     use_extension: bool = True) -> np.ndarray:
    """int64 array [num_samples + 1, 2] of (position in doc_idx, token offset); see the module docstring."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=np.int64)
    if seq_length < 1 or num_samples < 0:
        raise ValueError(f"need seq_length >= 1 and num_samples >= 0, got {seq_length} and {num_samples}")
    if len(doc_idx) and (int(doc_idx.min()) < 0 or int(doc_idx.max()) >= len(sizes)):
        raise ValueError(f"doc_idx holds ids outside [0, {len(sizes)})")
    available = int(sizes[doc_idx].sum(dtype=np.int64))
    if available < num_samples * seq_length + 1:
        raise ValueError(f"{num_samples} samples of {seq_length} tokens need {num_samples * seq_length + 1} tokens, "
                         f"the documents hold {available}")
    module = extension() if use_extension else None
    if module is not None:
        return module.build_sample_idx(sizes, doc_idx, seq_length, num_samples)
    starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The last document starting at or before each position; an empty document shares its start with the next
    # one, so side="right" skips it.
    k = np.searchsorted(starts, positions, side="right") - 1
    return np.stack([k, positions - starts[k]], axis=1)


def build_blending_indices(weights: Sequence[float], size: int,
                           use_extension: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) for normalized ``weights``."""
    weights = [float(w) for w in weights]
    if not 1 <= len(weights) <= 32767 or size < 0:
        raise ValueError(f"need 1 to 32767 weights and size >= 0, got {len(weights)} and {size}")
    module = extension() if use_extension else None
    if module is not None:
        return module.build_blending_indices(np.asarray(weights, dtype=np.float64), size)
    # The greedy choice depends on every earlier one, so this is a plain loop (about a second per million samples
    # with two datasets); Python floats round each operation as the C++ does.
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    taken = [0] * len(weights)
    candidates = list(enumerate(weights))
    for i in range(size):
        chosen, best = 0, 0.0
        for d, weight in candidates:
            error = weight * (i + 1) - taken[d]
            if d == 0 or error > best:
                chosen, best = d, error
        dataset_index[i] = chosen
        dataset_sample_index[i] = taken[chosen]
        taken[chosen] += 1
    return dataset_index, dataset_sample_index
