"""Supervised fine-tuning data (``--sft``): conversations, the loss on the assistant's tokens only.

Each ``--data-path`` source is one of:

- a JSON-lines file (``.jsonl``/``.json``), a Parquet file (``.parquet``), an Arrow file of the ``datasets`` library
  (``.arrow``) or a directory written by ``datasets.Dataset.save_to_disk``: one conversation per record, rendered and
  tokenized when the run starts (megalite.data.chat_template);
- a prefix written by ``tools/preprocess_data.py --sft``: ``PREFIX.bin/.idx`` the tokens of each conversation and
  ``PREFIX_loss_mask.bin/.idx`` its loss mask (uint8), one sequence per conversation.

A conversation longer than the sample (``--seq-length`` + 1 tokens, its end-of-document token included) is refused,
naming it: cutting it would train on a reply that never ends, or drop the reply entirely.

Samples hold ``seq_length + 1`` tokens as everywhere in megalite, and with them the loss mask: item ``i`` is a
LongTensor [2, seq_length + 1], the tokens and, per token, whether it counts as a label (the trainer applies it to
the labels, so it flows through context parallelism's sequence split and to the pipeline's last stage as the
``--eod-mask-loss`` mask does). With ``--reset-attention-mask`` several conversations are packed into a sample, in a
shuffled order, each whole (a conversation that no longer fits starts the next sample); the packed-documents
machinery (megalite.data.packing) gives each its own causal attention and, with ``--reset-position-ids``, its own
positions. Without it a sample holds one conversation. Either way the rest is padding: end-of-document tokens
outside the loss. ``--split`` cuts each source's conversations into train/valid/test ranges in file order, as for
documents; every epoch reshuffles them (seeded, the same on every rank and layout).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from megalite.config import MegaliteConfig
from megalite.config.flags import FLAG
from megalite.data.blended_dataset import BlendedDataset
from megalite.data.chat_template import ChatRenderer, conversation_messages
from megalite.data.errors import DataError
from megalite.data.gpt_dataset import SPLIT_NAMES, split_documents
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, check_token_range, token_dtype
from megalite.data.tokenizer import Tokenizer

LOSS_MASK_SUFFIX = "_loss_mask"   # PREFIX_loss_mask.bin/.idx beside a preprocessed SFT prefix's tokens


@dataclass
class Conversations:
    """One source's tokenized conversations: ``get(i)`` gives conversation i's (tokens, loss mask)."""
    name: str
    sizes: np.ndarray    # tokens per conversation
    tokens: list         # per conversation: int64 tokens (or an IndexedDataset)
    masks: list          # per conversation: uint8 loss mask (or an IndexedDataset)

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(self.tokens, list):
            return self.tokens[i], self.masks[i]
        return self.tokens.get(i), self.masks.get(i)


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of each conversation of a file or datasets directory."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{where}: not a JSON object ({error.msg})") from None
        return
    if suffix == ".parquet":
        import pyarrow.parquet   # noqa: PLC0415 - only when such a source is named

        rows = pyarrow.parquet.read_table(path).to_pylist()
    elif suffix == ".arrow" or path.is_dir():
        import datasets   # noqa: PLC0415 - only when such a source is named

        loaded = datasets.Dataset.from_file(str(path)) if suffix == ".arrow" else datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            raise DataError(f"{path}: a dataset with splits ({', '.join(loaded)}): name one split's directory, "
                            f"e.g. {path / next(iter(loaded))}")
        rows = loaded.to_list()
    else:
        raise DataError(f"{path}: not a .jsonl/.json, .parquet or .arrow file, a datasets directory, nor a prefix "
                        f"written by tools/preprocess_data.py --sft")
    for row_number, row in enumerate(rows):
        yield f"{path} row {row_number}", row


def _check_conversation(tokens: np.ndarray, mask: np.ndarray, where: str, seq_length: int, eod: int,
                        packing: bool) -> None:
    if len(tokens) > seq_length + 1:
        raise DataError(f"{where}: the conversation has {len(tokens)} tokens, more than a sample's "
                        f"{FLAG.seq_length} {seq_length} + 1: shorten it or raise {FLAG.seq_length}")
    if packing and bool((tokens[:-1] == eod).any()):
        raise DataError(f"{where}: the end-of-document token {eod} occurs inside the conversation (the chat "
                        f"template uses it), where {FLAG.reset_attention_mask}/{FLAG.reset_position_ids} would take "
                        f"it for the conversation's end: train without them (one conversation per sample)")
    if not mask.any():
        raise DataError(f"{where}: no token of the conversation is the assistant's (nothing to learn from)")


def _load(source: str, renderer: ChatRenderer, seq_length: int, packing: bool, cache_dir: Optional[Path],
          progress: bool) -> Conversations:
    prefix_mask = f"{source}{LOSS_MASK_SUFFIX}"
    if os.path.exists(f"{source}.idx") and os.path.exists(f"{prefix_mask}.idx"):
        tokens, masks = IndexedDataset(source), IndexedDataset(prefix_mask)
        if not np.array_equal(tokens.sizes, masks.sizes):
            raise DataError(f"{prefix_mask}.idx: its conversations' lengths differ from {source}.idx's")
        check_token_range(tokens, renderer.tokenizer.vocab_size, cache_dir, progress=progress)
        for i in range(len(tokens)):
            _check_conversation(tokens.get(i), masks.get(i), f"{source} conversation {i}", seq_length,
                                renderer.eod, packing)
        return Conversations(source, np.asarray(tokens.sizes, dtype=np.int64), tokens, masks)
    path = Path(source)
    if not path.exists():
        raise DataError(f"{source}: no such file or directory (nor {source}.idx with {prefix_mask}.idx)")
    all_tokens, all_masks = [], []
    for where, record in _records(path):
        rendered = renderer.render(conversation_messages(record, where), where)
        _check_conversation(rendered.tokens, rendered.mask, where, seq_length, renderer.eod, packing)
        all_tokens.append(rendered.tokens)
        all_masks.append(rendered.mask)
    if not all_tokens:
        raise DataError(f"{source}: no conversations")
    return Conversations(source, np.asarray([len(t) for t in all_tokens], dtype=np.int64), all_tokens, all_masks)


def write_preprocessed(sources: list[str], tokenizer: Tokenizer, prefix: str) -> tuple[int, int, int]:
    """tools/preprocess_data.py --sft: the conversations of ``sources`` rendered into ``prefix``.bin/.idx (tokens)
    and ``prefix``_loss_mask.bin/.idx (uint8 loss mask), one sequence per conversation; (conversations, tokens,
    trained tokens). Bad input stops it as it would stop a run, but no length is refused: the run's
    --seq-length decides that when it reads them."""
    renderer = ChatRenderer(tokenizer)
    counts = [0, 0, 0]
    with IndexedDatasetWriter(prefix, token_dtype(tokenizer.vocab_size)) as tokens, \
            IndexedDatasetWriter(f"{prefix}{LOSS_MASK_SUFFIX}", np.dtype(np.uint8)) as masks:
        for source in sources:
            for where, record in _records(Path(source)):
                rendered = renderer.render(conversation_messages(record, where), where)
                tokens.add_document(rendered.tokens)
                masks.add_document(rendered.mask)
                counts = [counts[0] + 1, counts[1] + len(rendered.tokens), counts[2] + int(rendered.mask.sum())]
    return counts[0], counts[1], counts[2]


# Sources rendered once per process: checked before any collective, then built into datasets.
_LOADED: dict[tuple, Conversations] = {}


def load_conversations(cfg: MegaliteConfig, tokenizer: Tokenizer) -> tuple[list[Conversations], Optional[list[float]]]:
    """Every --data-path source's conversations, checked (one-line DataError naming the file and record), and the
    blend's weights (None: by tokens)."""
    d, seq_length = cfg.data, cfg.model.seq_length
    packing = d.reset_attention_mask or d.reset_position_ids
    prefixes, weights = d.blend()
    renderer = None
    loaded = []
    for source in prefixes:
        stamped = source if os.path.exists(source) else f"{source}.idx"   # a file, a directory or a prefix
        stamp = os.stat(stamped).st_mtime_ns if os.path.exists(stamped) else None
        key = (os.path.abspath(source), stamp, tokenizer.fingerprint(), seq_length, packing)
        if key not in _LOADED:
            renderer = renderer or ChatRenderer(tokenizer)
            cache_dir = Path(d.data_cache_path) if d.data_cache_path else None
            _LOADED[key] = _load(source, renderer, seq_length, packing, cache_dir, progress=not cfg.logging.quiet)
        loaded.append(_LOADED[key])
    return loaded, weights


class SFTDataset:
    """``num_samples`` samples of conversations ``[first, last)`` of ``conversations``; item ``i`` is a LongTensor
    [2, seq_length + 1]: the tokens, and 1 where the token counts as a label (see the module docstring)."""

    def __init__(self, conversations: Conversations, documents: tuple[int, int], seq_length: int, num_samples: int,
                 seed: int, pack: bool, pad: int):
        self.conversations, self.seq_length, self.num_samples, self.pad = conversations, seq_length, num_samples, pad
        first, last = documents
        if last <= first:
            raise DataError(f"{conversations.name}: no conversations in the split")
        orders, starts, position, epoch = [], [], 0, 0
        capacity = seq_length + 1
        while len(starts) < num_samples:
            # Each epoch its own seeded order; a sample never spans two epochs.
            order = np.random.RandomState([seed % 2**32, 2, epoch]).permutation(np.arange(first, last))
            filled = capacity
            for size in conversations.sizes[order]:
                if not pack or filled + size > capacity:
                    starts.append(position)
                    filled = 0
                filled += int(size)
                position += 1
            orders.append(order)
            epoch += 1
        self.order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64)
        self.bounds = np.append(np.asarray(starts, dtype=np.int64), position)[:num_samples + 1]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of a dataset of {self.num_samples}")
        sample = np.zeros((2, self.seq_length + 1), dtype=np.int64)
        sample[0] = self.pad   # padding: end-of-document tokens outside the loss
        filled = 0
        for k in self.order[self.bounds[index]:self.bounds[index + 1]]:
            tokens, mask = self.conversations.get(int(k))
            sample[0, filled:filled + len(tokens)] = tokens
            sample[1, filled:filled + len(tokens)] = mask
            filled += len(tokens)
        return torch.from_numpy(sample)


def sft_splits(cfg: MegaliteConfig, num_samples: tuple[int, int, int], tokenizer: Tokenizer) -> list:
    """The (train, valid, test) datasets of ``num_samples`` samples each (None where a split has no conversations or
    is asked for none); a blend where --data-path names several sources."""
    sources, weights = load_conversations(cfg, tokenizer)
    d, seed = cfg.data, cfg.training.seed
    ranges = [split_documents(len(source), d.split_fractions()) for source in sources]
    if all(r[0][0] == r[0][1] for r in ranges):
        raise DataError(f"{sources[0].name}: {FLAG.split} {d.split} leaves no conversations for training (the data "
                        f"has {', '.join(str(len(s)) for s in sources)})")
    splits = []
    for s, (_, wanted) in enumerate(zip(SPLIT_NAMES, num_samples)):
        usable = [i for i, r in enumerate(ranges) if r[s][1] > r[s][0]]
        if wanted <= 0 or not usable:
            splits.append(None)
            continue

        def make(i: int, n: int, s: int = s) -> SFTDataset:
            return SFTDataset(sources[i], ranges[i][s], cfg.model.seq_length, n, seed + s, d.reset_attention_mask,
                              tokenizer.eod)

        if len(sources) == 1:
            splits.append(make(0, wanted))
            continue
        shares = ([weights[i] for i in usable] if weights is not None else
                  [float(sources[i].sizes[slice(*ranges[i][s])].sum()) for i in usable])
        splits.append(BlendedDataset(shares, wanted, lambda k, n: make(usable[k], n)))
    return splits
