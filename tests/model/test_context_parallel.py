"""Which tokens a context-parallel rank holds, and packed documents in one process: a document in a packed sample
is seen by the model exactly as if it were a sample of its own."""

from __future__ import annotations

import pytest
import torch

from megalite.data.packing import packed_documents
from megalite.model import GPTModel
from megalite.model.context_parallel import SequenceShard, local_indices, shard_sequence

from ..helpers import tiny_config

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py


def test_load_balanced_chunks_pair_early_with_late():
    assert [local_indices(8, 2, r, True).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [local_indices(8, 4, r, True).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [local_indices(8, 2, r, False).tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for cp, balanced in [(2, True), (4, True), (4, False)]:
        held = torch.cat([local_indices(64, cp, r, balanced) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(64))
        # Causal work per rank (keys at or before each query) is equal under the load balance.
        work = {int(local_indices(64, cp, r, balanced).add(1).sum()) for r in range(cp)}
        assert len(work) == 1 or not balanced


def test_every_ranks_indices_are_made_once_per_device():
    """The ring asks for a visiting rank's indices at every step of every layer: the same tensor each time, not a
    new one copied from the host."""
    indices = local_indices(16, 2, 0, True)
    shard = SequenceShard(16, indices, indices, None, "p2p", cp=2, cp_rank=0)
    other = shard.indices_of(1)
    assert other.tolist() == local_indices(16, 2, 1, True).tolist()
    assert shard.indices_of(1) is other
    assert SequenceShard(16, indices, indices, None, "allgather", cp=2, cp_rank=0).indices_of(1) is other
    assert shard_sequence(16, torch.device("cpu")).indices is shard_sequence(16, torch.device("cpu")).indices


def test_masks_are_block_diagonal_causal():
    documents = torch.tensor([[0, 0, 1, 1, 1]])
    shard = shard_sequence(5, torch.device("cpu"), documents=documents)
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(shard.whole_sequence_mask()[0, 0], expected.bool())
    assert shard_sequence(5, torch.device("cpu")).whole_sequence_mask() is None   # plain causal: SDPA's fast path


@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
def test_a_packed_document_is_seen_as_a_sample_of_its_own(positions):
    cfg = tiny_config(model={"position_embedding_type": positions}).model
    model = GPTModel(cfg, None)
    model.initialize(seed=5)
    eod = cfg.vocab_size - 1
    first, second = torch.randint(0, eod, (1, 11)), torch.randint(0, eod, (1, 20))
    packed = torch.cat([first, torch.tensor([[eod]]), second], dim=1)
    documents = packed_documents(packed, eod, reset_position_ids=True, reset_attention_mask=True)
    shard = shard_sequence(packed.shape[1], packed.device, positions=documents.positions,
                           documents=documents.documents)
    with torch.no_grad():
        together = model(packed, shard=shard)
        alone = model(second)
        unpacked = model(packed)   # without the switches the second document sees the first
    torch.testing.assert_close(together[:, 12:], alone, rtol=0, atol=1e-5)
    assert not torch.allclose(unpacked[:, 12:], alone, atol=1e-3)
