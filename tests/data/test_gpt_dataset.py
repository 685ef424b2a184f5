"""GPT samples, splits, blends and build_datasets: shapes, coverage, determinism, cached indices reused."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
import torch

from megalite.data import DataBundle, DataError, MockGPTDataset, build_datasets, check_data_files
from megalite.data.blended_dataset import BlendedDataset
from megalite.data.gpt_dataset import GPTDataset, split_documents
from megalite.data.index_cache import load_or_build
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

from ..helpers import tiny_config


def real_config(corpus, data_path=None, **data):
    return tiny_config(data={"mock_data": False, "data_path": data_path or str(corpus.prefix),
                             "tokenizer_model": str(corpus.tokenizer_model), **data})


def test_split_documents_uses_megatron_rounding():
    assert split_documents(1000, [0.969, 0.03, 0.001]) == [(0, 969), (969, 999), (999, 1000)]
    assert split_documents(100, [0.969, 0.03, 0.001]) == [(0, 97), (97, 100), (100, 100)]
    assert split_documents(7, [1.0, 0.0, 0.0]) == [(0, 7), (7, 7), (7, 7)]


def test_samples_span_documents_and_cover_the_stream(corpus, tmp_path):
    indexed = IndexedDataset(corpus.prefix)
    seq_length, first, last = 32, 10, 110
    tokens_in_split = int(indexed.sizes[first:last].sum())
    num_samples = 3 * tokens_in_split // seq_length  # about three epochs
    dataset = GPTDataset(indexed, (first, last), seq_length, num_samples, seed=7, cache_dir=tmp_path)
    assert len(dataset) == num_samples and dataset.num_epochs in (3, 4)
    item = dataset[0]
    assert item.dtype == torch.int64 and item.shape == (seq_length + 1,)
    stream = np.concatenate([indexed[int(d)] for d in dataset.doc_idx])
    for j in range(num_samples):
        np.testing.assert_array_equal(dataset.sample(j), stream[j * seq_length:(j + 1) * seq_length + 1])
    # Only the split's documents, each epoch a permutation of all of them.
    per_epoch = last - first
    for epoch in range(dataset.num_epochs):
        assert sorted(dataset.doc_idx[epoch * per_epoch:(epoch + 1) * per_epoch]) == list(range(first, last))
    assert sorted(dataset.shuffle_idx) == list(range(num_samples)) and list(dataset.shuffle_idx) != list(
        range(num_samples))
    with pytest.raises(IndexError):
        dataset[num_samples]


def test_indices_are_cached_and_reused(corpus, tmp_path):
    indexed = IndexedDataset(corpus.prefix)
    first = GPTDataset(indexed, (0, 300), 16, 500, seed=3, cache_dir=tmp_path, split="train")
    files = sorted(tmp_path.glob("docs-train-*"))
    assert [f.name.split("-")[-1] for f in files] == ["description.json", "doc_idx.npy", "sample_idx.npy",
                                                      "shuffle_idx.npy"]
    stamps = [f.stat().st_mtime_ns for f in files]
    again = GPTDataset(indexed, (0, 300), 16, 500, seed=3, cache_dir=tmp_path, split="train")
    assert [f.stat().st_mtime_ns for f in sorted(tmp_path.glob("docs-train-*"))] == stamps  # read, not rebuilt
    assert isinstance(again.sample_idx, np.memmap)
    assert all(torch.equal(first[i], again[i]) for i in range(0, 500, 37))
    # Another seed, length or count is another key; so is another index file.
    GPTDataset(indexed, (0, 300), 16, 500, seed=4, cache_dir=tmp_path, split="train")
    assert len(list(tmp_path.glob("docs-train-*-doc_idx.npy"))) == 2
    uncached = GPTDataset(indexed, (0, 300), 16, 500, seed=3, cache_dir=None)
    np.testing.assert_array_equal(uncached.shuffle_idx, first.shuffle_idx)


def test_blended_samples_follow_the_weights(corpus, tmp_path):
    # A second dataset whose tokens are all 3, so every sample tells which dataset it came from.
    with IndexedDatasetWriter(tmp_path / "threes", np.uint16) as writer:
        for length in range(1, 200):
            writer.add_document(np.full(length, 3))
    cfg = real_config(corpus, f"0.25 {corpus.prefix} 0.75 {tmp_path / 'threes'}", data_cache_path=str(tmp_path))
    bundle = build_datasets(cfg, (400, 40, 0))
    assert isinstance(bundle.train, BlendedDataset) and bundle.test is None
    from_threes = sum(bool((bundle.train[i] == 3).all()) for i in range(400))
    assert from_threes == 300
    assert abs(sum(bool((bundle.valid[i] == 3).all()) for i in range(40)) - 30) <= 1


def test_build_datasets(corpus, tmp_path):
    cfg = real_config(corpus, split="90,10,0")
    bundle = build_datasets(cfg, (64, 16, 16))
    assert isinstance(bundle, DataBundle)
    assert bundle.vocab_size == 601 and bundle.tokenizer.eod == 2
    assert len(bundle.train) == 64 and len(bundle.valid) == 16 and bundle.test is None
    assert bundle.train[5].shape == (cfg.model.seq_length + 1,)
    assert (corpus.directory / "megalite-cache").is_dir()  # the default cache: beside the data
    train_docs, valid_docs = split_documents(len(corpus.documents), cfg.data.split_fractions())[:2]
    assert set(bundle.valid.doc_idx) <= set(range(*valid_docs)) and set(bundle.train.doc_idx) <= set(
        range(*train_docs))
    assert build_datasets(cfg, (64, 0, 0)).valid is None
    again = build_datasets(cfg, (64, 16, 16))
    assert all(torch.equal(bundle.train[i], again.train[i]) for i in range(64))


def test_mock_bundle_splits_differ():
    cfg = tiny_config()
    bundle = build_datasets(cfg, (10, 4, 4))
    assert all(isinstance(d, MockGPTDataset) for d in (bundle.train, bundle.valid, bundle.test))
    assert (len(bundle.train), len(bundle.valid), bundle.tokenizer, bundle.vocab_size) == (10, 4, None, 301)
    assert not torch.equal(bundle.train[0], bundle.valid[0]) and not torch.equal(bundle.valid[0], bundle.test[0])
    assert torch.equal(bundle.train[3], MockGPTDataset(301, 32, cfg.training.seed)[3])  # what the trainer reads now


def test_unwritable_cache_falls_back_to_memory(corpus, tmp_path):
    (tmp_path / "file").write_text("a file where the cache directory would go")
    cfg = real_config(corpus, data_cache_path=str(tmp_path / "file" / "cache"))
    with pytest.warns(RuntimeWarning, match="cannot cache data indices"):
        bundle = build_datasets(cfg, (32, 0, 0))
    assert len(bundle.train) == 32 and bundle.train[31].shape == (33,)


def test_train_split_must_not_be_empty(corpus):
    with pytest.raises(DataError, match=r"--split 0,1,0 leaves no documents for training \(the data has 400\)"):
        check_data_files(real_config(corpus, split="0,1,0"))


def _build_concurrently(cache_dir, log, queue) -> None:
    def build():
        with open(log, "a") as handle:
            handle.write("build\n")
        time.sleep(0.3)
        return {"a": np.arange(5)}
    queue.put(load_or_build(cache_dir, "x", {"k": 1}, ["a"], build)["a"].tolist())


def test_one_process_builds_the_others_wait(tmp_path):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    children = [context.Process(target=_build_concurrently, args=(tmp_path, tmp_path / "log", queue))
                for _ in range(3)]
    for child in children:
        child.start()
    assert [queue.get(timeout=30) for _ in children] == [[0, 1, 2, 3, 4]] * 3
    for child in children:
        child.join(timeout=10)
    assert (tmp_path / "log").read_text() == "build\n"
    assert not list(tmp_path.glob("*.tmp"))
