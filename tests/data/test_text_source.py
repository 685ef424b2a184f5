"""Text sources in --data-path (Parquet, Arrow, JSON lines, save_to_disk directories): the same samples as the
preprocessed .bin/.idx of the same text, blends that keep their weights, and one-line errors for bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megalite.data import DataError, build_datasets, check_data_files
from megalite.data.blended_dataset import BlendedDataset

from .test_gpt_dataset import real_config


def _records(corpus) -> list[dict]:
    """The corpus's JSON lines as records (blank documents among them, which must be skipped)."""
    lines = corpus.jsonl.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _write_table(records: list[dict], path, row_group_size: int = 50):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(records)
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=row_group_size)   # several row groups: random reads cross them
    else:
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)
    return path


def _all_samples(bundle) -> list[np.ndarray]:
    return [dataset[i].numpy() for dataset in (bundle.train, bundle.valid) for i in range(len(dataset))]


def test_every_format_gives_the_samples_of_the_preprocessed_text(corpus, tmp_path):
    """The JSON-lines file itself, a Parquet file, an Arrow file and a save_to_disk directory of its records give
    the samples its preprocessed .bin/.idx (--append-eod) gives, in both splits; the counts are cached."""
    import datasets

    records = _records(corpus)
    sources = [str(corpus.jsonl), str(_write_table(records, tmp_path / "docs.parquet")),
               str(_write_table(records, tmp_path / "docs.arrow"))]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"), num_shards=2)   # two .arrow files
    sources.append(str(tmp_path / "saved"))
    cache = str(tmp_path / "cache")
    expected = _all_samples(build_datasets(real_config(corpus, split="9,1,0", data_cache_path=cache), (60, 20, 0)))
    for source in sources:
        cfg = real_config(corpus, source, split="9,1,0", data_cache_path=cache)
        got = _all_samples(build_datasets(cfg, (60, 20, 0)))
        assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected)), source
    assert len(list((tmp_path / "cache").glob("docs.parquet-documents-*-sizes.npy"))) == 1


def test_a_blend_of_a_text_source_and_a_prefix_keeps_its_weights(corpus, tmp_path):
    source = _write_table(_records(corpus), tmp_path / "docs.parquet")
    cfg = real_config(corpus, f"0.3 {source} 0.7 {corpus.prefix}", split="1,0,0", data_cache_path=str(tmp_path))
    train = build_datasets(cfg, (200, 0, 0)).train
    assert isinstance(train, BlendedDataset)
    for end in (8, 40, 200):   # every prefix of the blend (hence every global batch) holds its share, +- 1
        counts = np.bincount(np.asarray(train.dataset_index[:end]), minlength=2)
        assert abs(counts[0] - 0.3 * end) <= 1 and abs(counts[1] - 0.7 * end) <= 1
    parquet_only = build_datasets(real_config(corpus, str(source), split="1,0,0", data_cache_path=str(tmp_path)),
                                  (int(np.sum(train.dataset_index == 0)), 0, 0)).train
    first = int(np.argmax(train.dataset_index == 0))
    assert np.array_equal(train[first].numpy(), parquet_only[int(train.dataset_sample_index[first])].numpy())


@pytest.mark.parametrize("name, write, message", [
    ("docs.parquet", lambda path: _write_table([{"body": "some text"}], path),
     "docs.parquet: no column 'text' (see --json-keys; it has body)"),
    ("docs.parquet", lambda path: _write_table([{"text": 3}], path), "docs.parquet: column 'text' holds int64, not "
                                                                     "text (see --json-keys)"),
    ("docs.parquet", lambda path: path.write_bytes(b"PAR1 not really"), "docs.parquet: cannot be read as Parquet"),
    ("docs.jsonl", lambda path: path.write_text(""), "docs.jsonl: no text to train on (every text is empty or "
                                                     "blank)"),
    ("docs.jsonl", lambda path: path.write_text('{"body": "x"}\n'), "docs.jsonl:1: no key 'text' (see "
                                                                    "--json-keys)"),
    ("missing.arrow", None, "missing.arrow: no such file or directory"),
])
def test_a_bad_text_source_is_one_line(corpus, tmp_path, name, write, message):
    path = tmp_path / name
    if write is not None:
        write(path)
    with pytest.raises(DataError) as refused:
        check_data_files(real_config(corpus, f"0.5 {corpus.prefix} 0.5 {path}", data_cache_path=str(tmp_path)),
                         corpus.tokenizer)
    assert str(refused.value).startswith(f"{path.parent}/{message}") and "\n" not in str(refused.value)


def test_pretrain_gpt_names_the_column_it_lacks_in_one_line(corpus, tmp_path, capsys):
    import pretrain_gpt

    source = _write_table([{"body": "some text"}], tmp_path / "docs.parquet")
    argv = ["model=gpt_tiny", "--eval-interval", "0", "--data-path", str(source), "--json-keys", "text",
            "--tokenizer-model", str(corpus.tokenizer_model), "--data-cache-path", str(tmp_path)]
    assert pretrain_gpt.main(argv) == 2
    assert capsys.readouterr().err.strip() == (f"megalite: error: {source}: no column 'text' (see --json-keys; it "
                                               f"has body)")
