"""From the data options to the train/valid/test datasets: the one entry point the trainer calls.

Which data: ``--mock-data`` -> synthetic samples; ``--data-path`` -> those prefixes (or text sources, tokenized as
they are read: megalite.data.text_source) with the tokenizer options; neither
-> the built-in corpus (built on first use). Each prefix's documents are cut into train/valid/test ranges by
``--split``; with several prefixes every split is a blend of the prefixes' same split, by the given weights or, with
none given, by each prefix's number of tokens in that split. ``--sft``: ``--data-path`` names conversations
(megalite.data.sft).

Nothing here talks to other processes. :func:`check_data_files` is cheap enough for every rank to run before any
collective (headers and sizes; the token-range scan is done once per file and remembered), so a bad file stops every
rank with the same one-line :class:`DataError` instead of hanging the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

import torch

from megalite.config import MegaliteConfig
from megalite.config.schema import multi_word_values
from megalite.data.blended_dataset import BlendedDataset
from megalite.data.default_corpus import ensure_default_corpus
from megalite.data.errors import DataError
from megalite.data.gpt_dataset import SPLIT_NAMES, GPTDataset, split_documents
from megalite.data.indexed_dataset import IndexedDataset, check_token_range
from megalite.data.mock import MockGPTDataset
from megalite.data.sft import load_conversations, sft_splits
from megalite.data.text_source import TextSource, is_text_source
from megalite.data.tokenizer import Tokenizer, build_tokenizer, configured_tokenizer

CACHE_DIR_NAME = "megalite-cache"
# Mock valid/test samples come from other seeds than train's, so evaluating never scores training samples.
_MOCK_SEED_OFFSETS = (0, 1, 2)


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> torch.Tensor: ...


@dataclass
class DataBundle:
    """The datasets of one run; item ``i`` of each is a LongTensor of ``seq_length + 1`` tokens (with --sft
    [2, seq_length + 1]: the tokens and their loss mask, megalite.data.sft)."""
    train: Optional[Dataset]
    valid: Optional[Dataset]     # None when the split leaves it no documents or it was asked for no samples
    test: Optional[Dataset]
    vocab_size: int              # the tokenizer's, or --vocab-size for mock data
    tokenizer: Optional[Tokenizer]


@dataclass
class _Sources:
    prefixes: list[str]
    weights: Optional[list[float]]
    tokenizer: Tokenizer
    cache_dirs: list[Path]       # one per prefix: where its indices are cached
    blend_cache_dir: Path
    json_keys: list[str]         # the documents' keys in text sources


def run_tokenizer(cfg: MegaliteConfig) -> Optional[Tokenizer]:
    """The tokenizer the run reads its data with: the tokenizer options', the built-in corpus's, or None (mock
    data)."""
    d = cfg.data
    if d.mock_data:
        return None
    if d.data_path is None:
        return build_tokenizer("SentencePieceTokenizer", ensure_default_corpus().tokenizer_model, cfg.model.vocab_size)
    return configured_tokenizer(d, cfg.model.vocab_size)


def _sources(cfg: MegaliteConfig, tokenizer: Optional[Tokenizer]) -> _Sources:
    d = cfg.data
    tokenizer = tokenizer or run_tokenizer(cfg)
    if d.data_path is None:
        prefixes, weights = [ensure_default_corpus().prefix], None
    else:
        prefixes, weights = d.blend()
    if d.data_cache_path is not None:
        cache_dirs = [Path(d.data_cache_path)] * len(prefixes)
    else:
        cache_dirs = [Path(prefix).parent / CACHE_DIR_NAME for prefix in prefixes]
    return _Sources(prefixes, weights, tokenizer, cache_dirs, cache_dirs[0], multi_word_values(d.json_keys))


def _open(sources: _Sources, progress: bool) -> list[IndexedDataset]:
    """Every prefix opened (headers and sizes validated) and its tokens checked against the vocabulary; every text
    source opened and its documents' tokens counted (once: the counts are cached)."""
    datasets = []
    for prefix, cache_dir in zip(sources.prefixes, sources.cache_dirs):
        if is_text_source(prefix):   # tokenized by the run's tokenizer as it is read: no range to check
            datasets.append(TextSource(prefix, sources.json_keys, sources.tokenizer, cache_dir, progress))
            continue
        indexed = IndexedDataset(prefix)
        if len(indexed) == 0:
            raise DataError(f"{indexed.index_path}: the dataset has no documents")
        check_token_range(indexed, sources.tokenizer.vocab_size, cache_dir, progress=progress)
        datasets.append(indexed)
    return datasets


def _checked(cfg: MegaliteConfig, tokenizer: Optional[Tokenizer]) -> tuple[_Sources, list[IndexedDataset]]:
    sources = _sources(cfg, tokenizer)
    indexed = _open(sources, progress=not cfg.logging.quiet)
    fractions = cfg.data.split_fractions()
    if all(first == last for first, last in (split_documents(len(d), fractions)[0] for d in indexed)):
        raise DataError(f"{indexed[0].index_path}: --split {cfg.data.split} leaves no documents for training "
                        f"(the data has {', '.join(str(len(d)) for d in indexed)})")
    return sources, indexed


def check_data_files(cfg: MegaliteConfig, tokenizer: Optional[Tokenizer] = None) -> None:
    """Raise DataError (one line naming the file) if a data or tokenizer file is missing, truncated or corrupt, or
    holds tokens outside the vocabulary, or if the split leaves nothing to train on. Builds the built-in corpus if it
    is the one used and not built yet. Costs a pass over each .bin the first time only (the verdict is cached).
    ``tokenizer``: the run's (megalite.run built it), else built here."""
    if cfg.data.sft:
        load_conversations(cfg, tokenizer or run_tokenizer(cfg))
    elif not cfg.data.mock_data:
        _checked(cfg, tokenizer)


def build_datasets(cfg: MegaliteConfig, num_samples: tuple[int, int, int],
                   tokenizer: Optional[Tokenizer] = None) -> DataBundle:
    """The (train, valid, test) datasets holding ``num_samples`` samples each, read with ``tokenizer`` (the run's;
    built here when not given) (checks the files as :func:`check_data_files` does, cheaply when that already ran)."""
    m, seed = cfg.model, cfg.training.seed
    if cfg.data.mock_data:
        mocks = [MockGPTDataset(m.vocab_size, m.seq_length, seed + offset, n)
                 for offset, n in zip(_MOCK_SEED_OFFSETS, num_samples)]
        return DataBundle(*mocks, vocab_size=m.vocab_size, tokenizer=None)
    if cfg.data.sft:
        tokenizer = tokenizer or run_tokenizer(cfg)
        return DataBundle(*sft_splits(cfg, num_samples, tokenizer), vocab_size=tokenizer.vocab_size,
                          tokenizer=tokenizer)
    sources, indexed = _checked(cfg, tokenizer)
    fractions = cfg.data.split_fractions()
    ranges = [split_documents(len(dataset), fractions) for dataset in indexed]
    splits = []
    for s, (name, wanted) in enumerate(zip(SPLIT_NAMES, num_samples)):
        splits.append(_split(sources, indexed, [r[s] for r in ranges], name, wanted, m.seq_length, seed,
                             progress=not cfg.logging.quiet))
    return DataBundle(*splits, vocab_size=sources.tokenizer.vocab_size, tokenizer=sources.tokenizer)


def _split(sources: _Sources, indexed: list[IndexedDataset], ranges: list[tuple[int, int]], name: str,
           num_samples: int, seq_length: int, seed: int, progress: bool) -> Optional[Dataset]:
    """One split: a GPTDataset, a blend of them, or None if it has no documents or is asked for no samples
    (``progress``: bars while indices are built)."""
    usable = [i for i, (first, last) in enumerate(ranges) if last > first]
    if num_samples <= 0 or not usable:
        return None

    def make(i: int, n: int) -> GPTDataset:
        return GPTDataset(indexed[i], ranges[i], seq_length, n, seed, sources.cache_dirs[i], name, progress)

    if len(indexed) == 1:
        return make(0, num_samples)
    if sources.weights is not None:
        weights = [sources.weights[i] for i in usable]
    else:  # no weights given: each prefix weighs its tokens in this split
        weights = [float(indexed[i].sizes[slice(*ranges[i])].sum()) for i in usable]
    if sum(weights) <= 0:
        return None
    return BlendedDataset(weights, num_samples, lambda d, n: make(usable[d], n), sources.blend_cache_dir)
