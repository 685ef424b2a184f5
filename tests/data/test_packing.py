"""Packed documents: positions, documents and loss mask derived from the EOD token, against Megatron's loop."""

from __future__ import annotations

import torch

from megalite.data.packing import packed_documents

EOD = 9


def _megatron_style(tokens: torch.Tensor, eod: int):
    """Megatron's get_ltor_masks_and_position_ids, written as its loops: for each EOD at i, later tokens lose sight
    of tokens <= i and their positions restart at i + 1."""
    batch, seq = tokens.shape
    allowed = torch.ones(batch, seq, seq, dtype=torch.bool).tril()
    positions = torch.arange(seq).repeat(batch, 1)
    for b in range(batch):
        previous = 0
        for i in (tokens[b] == eod).nonzero().flatten().tolist():
            allowed[b, i + 1:, : i + 1] = False
            positions[b, i + 1:] -= i + 1 - previous
            previous = i + 1
    loss_mask = (tokens != eod).float()
    return allowed, positions, loss_mask


def test_a_hand_made_sample():
    tokens = torch.tensor([[1, 2, EOD, 3, 4, 5, EOD, EOD, 6]])
    packed = packed_documents(tokens, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]
    assert packed.documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3]]   # an EOD belongs to the document it ends
    assert packed.loss_mask.tolist() == [[1, 1, 0, 1, 1, 1, 0, 0, 1]]


def test_matches_megatron_on_random_samples():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 12, (4, 40), generator=generator)   # EOD = 9: about one token in twelve
    packed = packed_documents(tokens, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    allowed, positions, loss_mask = _megatron_style(tokens, EOD)
    documents = packed.documents
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    assert torch.equal((documents[:, :, None] == documents[:, None, :]) & causal, allowed)
    assert torch.equal(packed.positions, positions)
    assert torch.equal(packed.loss_mask, loss_mask)


def test_switches_off_give_nothing_to_change():
    tokens = torch.tensor([[1, EOD, 2]])
    packed = packed_documents(tokens, EOD)
    assert packed.positions is None and packed.documents is None and packed.loss_mask.tolist() == [[1, 1, 1]]
