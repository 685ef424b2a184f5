"""Tokenize documents into an indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) with N worker processes.

Documents go to the workers in windows of a few thousand, at most two windows in flight (so reading never runs ahead
of tokenizing and memory stays bounded, which ``Pool.imap`` over the whole input would not), and are written back in
input order, so the output does not depend on the number of workers. Blank documents (only whitespace) and those
that encode to no tokens are skipped, not fatal. A progress bar on stderr (megalite.progress) shows the input read,
its rate and the time left, when the documents know their inputs' size (megalite.data.documents), and the documents
and tokens written; off a terminal, a line every 10 s instead.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from megalite.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from megalite.data.tokenizer import Tokenizer
from megalite.progress import Progress, format_count

_CHUNK = 16  # documents per task handed to a worker: large enough to amortize the pickling round trip
_WINDOW_PER_WORKER = 64 * _CHUNK


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    skipped: int = 0      # blank documents, or ones that encoded to nothing
    bytes: int = 0        # UTF-8 bytes of text read
    seconds: float = 0.0


class _Bar:
    """The bar over the input bytes read (or, for documents that do not count them, the text bytes encoded)."""

    def __init__(self, documents: Iterable[str], stream: TextIO | None):
        self.documents = documents
        self.progress = Progress(getattr(documents, "total_bytes", None), "tokenizing", "bytes",
                                 enabled=stream is not None, stream=stream, log_interval_s=10.0)

    def update(self, stats: PreprocessStats) -> None:
        self.progress.note = f"{format_count(stats.documents)} docs, {format_count(stats.tokens)} tokens"
        self.progress.set(getattr(self.documents, "bytes_read", stats.bytes))


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode(tokenizer: Tokenizer, text: str, append_eod: bool, dtype: np.dtype) -> tuple[np.ndarray, int]:
    ids = tokenizer.encode(text) if text.strip() else []
    if append_eod and ids:
        ids.append(tokenizer.eod)
    return np.asarray(ids, dtype=dtype), len(text.encode("utf-8"))


def _encode_in_worker(args: tuple[str, bool, np.dtype]) -> tuple[np.ndarray, int]:
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, *args)


def preprocess(documents: Iterable[str], tokenizer: Tokenizer, output_prefix: str | os.PathLike, workers: int = 1,
               append_eod: bool = True, progress: TextIO | None = sys.stderr) -> PreprocessStats:
    """Encode ``documents`` into ``output_prefix``.bin/.idx (uint16 tokens if the vocabulary fits, else int32)."""
    dtype = token_dtype(tokenizer.vocab_size)
    stats, bar, start = PreprocessStats(), _Bar(documents, progress), time.perf_counter()
    tasks = ((text, append_eod, dtype) for text in documents)
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        if workers <= 1:
            results: Iterable[tuple[np.ndarray, int]] = (_encode(tokenizer, *task) for task in tasks)
            _write(results, writer, stats, bar)
        else:
            with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
                _write(_in_windows(pool, tasks, workers), writer, stats, bar)
    stats.seconds = time.perf_counter() - start
    bar.update(stats)
    bar.progress.close()
    return stats


def _in_windows(pool, tasks: Iterator[tuple[str, bool, np.dtype]],
                workers: int) -> Iterator[tuple[np.ndarray, int]]:
    """Results of ``tasks`` in order, submitting the next window while the current one is being tokenized."""
    window = _WINDOW_PER_WORKER * workers
    pending: collections.deque = collections.deque()
    while True:
        batch = list(itertools.islice(tasks, window))
        if batch:
            pending.append(pool.map_async(_encode_in_worker, batch, chunksize=_CHUNK))
        if not pending:
            return
        if len(pending) == 2 or not batch:
            yield from pending.popleft().get()


def _write(results: Iterable[tuple[np.ndarray, int]], writer: IndexedDatasetWriter, stats: PreprocessStats,
           bar: _Bar) -> None:
    for tokens, size in results:
        stats.bytes += size
        if len(tokens) == 0:
            stats.skipped += 1
            continue
        writer.add_document(tokens)
        stats.documents += 1
        stats.tokens += len(tokens)
        bar.update(stats)
