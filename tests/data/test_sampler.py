"""One iteration reads the same global batch whatever DP and the micro-batch size are; samples are deterministic;
a run resumed at consumed sample k reads the same next batches as one that never stopped."""

from __future__ import annotations

import pytest
import torch

from megalite.data import MockGPTDataset, micro_batch_indices
from megalite.data.gpt_dataset import GPTDataset
from megalite.data.indexed_dataset import IndexedDataset


@pytest.mark.parametrize("dp, micro_batch_size", [(1, 8), (1, 2), (2, 2), (4, 1), (8, 1), (2, 4)])
def test_each_iteration_covers_its_global_batch_once(dp, micro_batch_size):
    global_batch = 8
    for consumed in (0, 8, 16):
        num_micro = global_batch // (micro_batch_size * dp)
        seen = [i for rank in range(dp)
                for batch in micro_batch_indices(consumed, micro_batch_size, num_micro, rank, dp) for i in batch]
        assert sorted(seen) == list(range(consumed, consumed + global_batch))


def test_mock_samples_depend_only_on_seed_and_index():
    a, b = MockGPTDataset(301, 32, seed=5), MockGPTDataset(301, 32, seed=5)
    assert torch.equal(a[17], b[17])
    assert a[17].shape == (33,)
    assert not torch.equal(a[17], a[18])
    assert not torch.equal(a[17], MockGPTDataset(301, 32, seed=6)[17])
    assert int(a[3].max()) < 301


def _run(dataset, start_iteration: int, iterations: int, global_batch: int, micro_batch_size: int, dp: int):
    """The global batches (samples in global order) that iterations [start, start + iterations) read."""
    num_micro = global_batch // (micro_batch_size * dp)
    batches = []
    for iteration in range(start_iteration, start_iteration + iterations):
        consumed = iteration * global_batch  # what a checkpoint of the previous iteration records
        per_rank = [micro_batch_indices(consumed, micro_batch_size, num_micro, rank, dp) for rank in range(dp)]
        # Put the global batch back in order: micro-step m, then DP rank, then position.
        order = [i for m in range(num_micro) for rank in range(dp) for i in per_rank[rank][m]]
        batches.append(torch.stack([dataset[i] for i in order]))
    return batches


@pytest.mark.parametrize("dp, micro_batch_size", [(1, 8), (2, 2), (4, 1)])
def test_resumed_run_reads_the_same_batches(corpus, tmp_path, dp, micro_batch_size):
    # A real GPT dataset, rebuilt on restart from its cached indices, as a resumed job does.
    def open_dataset():
        return GPTDataset(IndexedDataset(corpus.prefix), (0, 300), 16, 10 * 8, seed=11, cache_dir=tmp_path)

    uninterrupted = _run(open_dataset(), 0, 10, 8, micro_batch_size, dp)
    resumed = _run(open_dataset(), 0, 4, 8, micro_batch_size, dp) + _run(open_dataset(), 4, 6, 8, micro_batch_size,
                                                                          dp)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True))
    # ... and the same global batches as the single-rank layout with 8-sample micro-batches.
    reference = _run(open_dataset(), 0, 10, 8, 8, 1)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, reference, strict=True))
