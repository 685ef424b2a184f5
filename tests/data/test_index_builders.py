"""Sample and blending index builders: C++ and numpy give identical arrays; no token is dropped or repeated; blends
follow their weights."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megalite.data import index_builders
from megalite.data.index_builders import build_blending_indices, build_sample_idx


@pytest.fixture(scope="module")
def compiled():
    if os.environ.get("MEGALITE_DISABLE_EXTENSIONS") == "1":
        pytest.skip("C++ extensions disabled (MEGALITE_DISABLE_EXTENSIONS=1)")
    module = index_builders.extension()
    assert module is not None, "csrc/data_index_builders.cpp did not build (see the warning)"
    return module


def random_documents(seed: int, num_docs: int = 300, epochs: int = 3):
    rng = np.random.RandomState(seed)
    sizes = rng.randint(0, 40, num_docs).astype(np.int32)
    sizes[rng.rand(num_docs) < 0.1] = 0  # empty documents must be stepped over
    doc_idx = np.concatenate([rng.permutation(num_docs) for _ in range(epochs)]).astype(np.int64)
    return sizes, doc_idx


def stream_of(sizes: np.ndarray, doc_idx: np.ndarray) -> np.ndarray:
    """Tokens named by (document, offset) so that each is recognizable: document * 1000 + offset."""
    return np.concatenate([d * 1000 + np.arange(sizes[d]) for d in doc_idx])


@pytest.mark.parametrize("seed, seq_length", [(0, 1), (1, 7), (2, 32), (3, 129)])
def test_sample_index_cpp_equals_numpy(compiled, seed, seq_length):
    sizes, doc_idx = random_documents(seed)
    num_samples = (int(sizes[doc_idx].sum()) - 1) // seq_length  # as many as the tokens allow
    cpp = build_sample_idx(sizes, doc_idx, seq_length, num_samples)
    numpy = build_sample_idx(sizes, doc_idx, seq_length, num_samples, use_extension=False)
    assert cpp.dtype == numpy.dtype == np.int64 and cpp.shape == (num_samples + 1, 2)
    np.testing.assert_array_equal(cpp, numpy)


@pytest.mark.parametrize("use_extension", [True, False])
def test_samples_cover_the_stream_exactly_once(use_extension, compiled):
    sizes, doc_idx = random_documents(4)
    seq_length = 16
    stream = stream_of(sizes, doc_idx)
    num_samples = (len(stream) - 1) // seq_length
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_samples, use_extension=use_extension)
    assert (sizes[doc_idx[sample_idx[:, 0]]] > sample_idx[:, 1]).all()  # never a position inside an empty document
    targets = []
    for j in range(num_samples):
        (k0, o0), (k1, o1) = sample_idx[j], sample_idx[j + 1]
        tokens = np.concatenate([doc_idx[k] * 1000 + np.arange(sizes[doc_idx[k]]) for k in range(k0, k1 + 1)])
        tokens = tokens[o0:len(tokens) - (sizes[doc_idx[k1]] - o1) + 1]
        assert len(tokens) == seq_length + 1
        np.testing.assert_array_equal(tokens, stream[j * seq_length:(j + 1) * seq_length + 1])
        targets.append(tokens[1:])
    # Every token after the first is a label exactly once, in order: none dropped, none repeated.
    np.testing.assert_array_equal(np.concatenate(targets), stream[1:num_samples * seq_length + 1])


def test_sample_index_rejects_too_few_tokens():
    sizes, doc_idx = np.array([3, 4], dtype=np.int32), np.array([0, 1])
    build_sample_idx(sizes, doc_idx, 3, 2)       # 7 tokens make 2 samples of 3 (+1)
    with pytest.raises(ValueError, match="need 10 tokens"):
        build_sample_idx(sizes, doc_idx, 3, 3)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.25, 0.125, 0.125], [1 / 3, 1 / 3, 1 / 3], [1.0],
                                     [0.01, 0.99], [0.2, 0.0, 0.8]])
def test_blending_cpp_equals_numpy_and_follows_the_weights(compiled, weights):
    size = 20_000
    cpp = build_blending_indices(weights, size)
    numpy = build_blending_indices(weights, size, use_extension=False)
    for a, b in zip(cpp, numpy):
        np.testing.assert_array_equal(a, b)
    dataset_index, dataset_sample_index = cpp
    assert dataset_index.dtype == np.int16 and dataset_sample_index.dtype == np.int64
    # Every prefix (hence every global batch) is within one sample per dataset of its share, far inside 1%.
    counts = np.zeros(len(weights))
    for n in (100, 1000, size):
        counts = np.bincount(dataset_index[:n], minlength=len(weights))
        assert np.abs(counts - np.array(weights) * n).max() <= 1.0
    assert np.abs(counts / size - np.array(weights)).max() < 0.01
    # dataset_sample_index counts each dataset's samples 0, 1, 2, ... in order.
    for d in range(len(weights)):
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == d], np.arange(counts[d]))
