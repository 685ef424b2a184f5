"""Packed documents: a sample is a window of the document stream, so it may hold the end of one document, whole
ones, and the start of another, each ended by the end-of-document (EOD) token. Megatron's three switches say how
much the model should know of the boundaries; this derives, from the tokens alone, what each needs:

- ``--reset-position-ids``: the position of a token within its document (0 right after an EOD), for the position
  embeddings and rotary angles;
- ``--reset-attention-mask``: the document of every token (the EOD belongs to the document it ends), so attention
  is block-diagonal causal: a token sees the tokens at or before it in its own document;
- ``--eod-mask-loss``: no loss where the input token is an EOD (the prediction of the next document's first token
  from the previous one's end), as Megatron's ``loss_mask[tokens == eod] = 0``.

Pure tensor functions of the input tokens [batch, seq] (the sample without its last token), computed on every rank
for the whole sample: context-parallel ranks then take their tokens' share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Documents:
    positions: Optional[torch.Tensor]   # [batch, seq] position within the document (None: not reset)
    documents: Optional[torch.Tensor]   # [batch, seq] document index within the sample (None: attention not reset)
    loss_mask: torch.Tensor             # [batch, seq] fp32, 0 where the loss is skipped


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[batch, seq]: how many EOD tokens come strictly before each token in its sample."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=1) - is_eod


def positions_in_documents(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[batch, seq]: each token's distance from the start of its document (the token after the last EOD before it,
    or the sample's start)."""
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    after_eod = torch.where(tokens == eod, index + 1, torch.zeros_like(index))
    # The start of a token's document is the largest "index after an EOD" strictly before it.
    starts = torch.cummax(torch.nn.functional.pad(after_eod[:, :-1], (1, 0)), dim=1).values
    return index - starts


def packed_documents(tokens: torch.Tensor, eod: int, *, reset_position_ids: bool = False,
                     reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> Documents:
    """What the three switches need of input tokens [batch, seq] (see the module docstring)."""
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    if eod_mask_loss:
        loss_mask.masked_fill_(tokens == eod, 0.0)
    return Documents(positions_in_documents(tokens, eod) if reset_position_ids else None,
                     document_ids(tokens, eod) if reset_attention_mask else None, loss_mask)
