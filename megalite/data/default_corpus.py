"""The built-in corpus: real text on every machine, so a run without ``--data-path`` trains on something real at once.

Source: the ``.py`` files of the running interpreter's standard library (``sysconfig``'s ``stdlib`` path), without
test suites (``test``, ``tests``, ``idle_test`` directories: large, repetitive, full of deliberately odd text) and
``site-packages``. Files are taken in the order of the md5 of their relative path (a fixed pseudo-random order, so
the subset spans the whole library instead of its first letters) until 4 MB of text; one file is one document.

Built once into ``$MEGALITE_CACHE_DIR`` (default ``~/.cache/megalite``) under ``default_corpus/<python>-<hash>/``:
a BPE SentencePiece tokenizer of 4096 pieces trained on those files (one thread, so it is the same model on any
machine), then ``corpus.bin``/``corpus.idx`` (about 1.3 M tokens with EOD after each file). Measured on 2 CPU cores
with Python 3.11: about 3 s in all. Processes that start together (the ranks of one job) take an flock: one builds,
the others wait, and all then reuse the files; ``manifest.json`` is written last and marks a finished build.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from megalite.data.atomic import exclusive_lock, write_atomically
from megalite.data.errors import DataError
from megalite.data.preprocess import preprocess
from megalite.data.tokenizer import SentencePieceTokenizer, train_sentencepiece

CACHE_ENV = "MEGALITE_CACHE_DIR"
MAX_BYTES = 4_000_000
VOCAB_SIZE = 4096
_VERSION = 1  # bump when the recipe changes, so an old build is not reused
_SKIPPED_DIRECTORIES = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class DefaultCorpus:
    prefix: str            # of corpus.bin / corpus.idx
    tokenizer_model: str


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megalite")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_dir() -> Path:
    """Where this interpreter's build lives: one per Python version and standard-library location."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = hashlib.md5(f"{_VERSION} {sys.version} {stdlib_dir()}".encode()).hexdigest()[:10]
    return cache_root() / "default_corpus" / f"{version}-{key}"


def stdlib_files(max_bytes: int = MAX_BYTES) -> list[Path]:
    """The corpus's files: see the module docstring."""
    root = stdlib_dir()
    candidates = [p for p in root.rglob("*.py")
                  if p.is_file() and not _SKIPPED_DIRECTORIES & set(p.relative_to(root).parts[:-1])]
    candidates.sort(key=lambda p: hashlib.md5(p.relative_to(root).as_posix().encode()).hexdigest())
    chosen, total = [], 0
    for path in candidates:
        if total >= max_bytes:
            break
        size = path.stat().st_size
        chosen.append(path)
        total += size
    return chosen


def _documents(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable file is just not part of the corpus
        if text.strip():
            texts.append(text)
    return texts


def ensure_default_corpus() -> DefaultCorpus:
    """The corpus's files, building them first if this machine has none yet (safe from many processes at once)."""
    directory = corpus_dir()
    corpus = DefaultCorpus(str(directory / "corpus"), str(directory / "tokenizer.model"))
    manifest = directory / "manifest.json"
    if manifest.is_file():
        return corpus
    try:
        with exclusive_lock(directory / ".lock"):
            if not manifest.is_file():  # else another process built it while this one waited
                _build(directory, corpus, manifest)
    except OSError as error:
        raise DataError(f"{directory}: cannot build the built-in corpus there ({error.strerror or error}); set "
                        f"${CACHE_ENV} to a writable directory or pass --data-path") from None
    return corpus


def _build(directory: Path, corpus: DefaultCorpus, manifest: Path) -> None:
    start = time.perf_counter()
    print(f"megalite: building the built-in corpus in {directory} (once)", file=sys.stderr, flush=True)
    files = stdlib_files()
    documents = _documents(files)
    if not documents:
        raise DataError(f"{stdlib_dir()}: no Python standard library sources found for the built-in corpus; "
                        f"pass --data-path")
    train_sentencepiece(documents, directory / "tokenizer", VOCAB_SIZE, num_threads=1)
    tokenizer_seconds = time.perf_counter() - start
    stats = preprocess(documents, SentencePieceTokenizer(corpus.tokenizer_model), corpus.prefix, workers=1,
                       append_eod=True, progress=None)
    summary = {"version": _VERSION, "python": sys.version, "stdlib": str(stdlib_dir()), "files": len(files),
               "documents": stats.documents, "bytes": stats.bytes, "tokens": stats.tokens, "vocab_size": VOCAB_SIZE,
               "tokenizer_seconds": round(tokenizer_seconds, 2),
               "total_seconds": round(time.perf_counter() - start, 2)}
    write_atomically(manifest, (json.dumps(summary, indent=1) + "\n").encode())
    print(f"megalite: built-in corpus ready: {stats.documents} files, {stats.tokens:,} tokens, "
          f"{summary['total_seconds']} s", file=sys.stderr, flush=True)
