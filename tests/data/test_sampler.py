"""One iteration reads the same global batch whatever DP and the micro-batch size are; samples are deterministic."""

from __future__ import annotations

import pytest
import torch

from megalite.data import MockGPTDataset, micro_batch_indices


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
