"""The built-in corpus: built from the standard library in well under a minute, once, by one of several processes
starting together, then reused; runs with no data options train on it."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest

from megalite.config import validate
from megalite.data import DataError, build_datasets, check_data_files, default_corpus
from megalite.data.default_corpus import CACHE_ENV, ensure_default_corpus
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizer import SentencePieceTokenizer

from ..helpers import tiny_config


def _build_in_child(queue) -> None:
    queue.put(ensure_default_corpus())


def test_built_once_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    builds = tmp_path / "builds.log"
    real_build = default_corpus._build

    def counting_build(*args):
        with open(builds, "a") as log:
            log.write("build\n")
        real_build(*args)

    monkeypatch.setattr(default_corpus, "_build", counting_build)
    # Three processes (forked: they share this test's patches) ask at once, as the ranks of one job do.
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    start = time.perf_counter()
    children = [context.Process(target=_build_in_child, args=(queue,)) for _ in range(3)]
    for child in children:
        child.start()
    results = [queue.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=30)
        assert child.exitcode == 0
    seconds = time.perf_counter() - start
    assert seconds < 60, f"the built-in corpus took {seconds:.1f} s to build"
    assert builds.read_text() == "build\n"  # one builder, the others waited for it
    assert len(set(results)) == 1
    corpus = results[0]
    manifest = json.loads((default_corpus.corpus_dir() / "manifest.json").read_text())
    assert manifest["files"] > 100 and manifest["tokens"] > 500_000

    # Reused: no second build, and fast.
    start = time.perf_counter()
    assert ensure_default_corpus() == corpus
    assert time.perf_counter() - start < 0.1 and builds.read_text() == "build\n"

    tokenizer, data = SentencePieceTokenizer(corpus.tokenizer_model), IndexedDataset(corpus.prefix)
    assert tokenizer.vocab_size == default_corpus.VOCAB_SIZE
    assert "def " in tokenizer.decode(data[0][:-1].tolist())

    # No data options at all: the config is valid and build_datasets trains on the corpus.
    cfg = tiny_config(data={"mock_data": False})
    validate(cfg, 1)
    check_data_files(cfg)
    bundle = build_datasets(cfg, (16, 8, 8))
    assert bundle.vocab_size == default_corpus.VOCAB_SIZE and len(bundle.train) == 16
    assert bundle.train[0].shape == (cfg.model.seq_length + 1,)


def test_stdlib_subset_is_deterministic_and_capped():
    files = default_corpus.stdlib_files()
    assert files == default_corpus.stdlib_files()
    total = sum(f.stat().st_size for f in files)
    assert default_corpus.MAX_BYTES <= total < default_corpus.MAX_BYTES + max(f.stat().st_size for f in files)
    root = default_corpus.stdlib_dir()
    assert not any({"test", "tests", "site-packages"} & set(f.relative_to(root).parts) for f in files)


def test_unwritable_cache_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file"))
    with pytest.raises(DataError) as error:
        ensure_default_corpus()
    assert "cannot build the built-in corpus there" in str(error.value) and "\n" not in str(error.value)
