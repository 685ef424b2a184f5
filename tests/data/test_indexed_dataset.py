"""The .bin/.idx format: written and read back, and every kind of damage reported as one line naming the file."""

from __future__ import annotations

import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from megalite.data import DataError, check_data_files
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, check_token_range

from ..helpers import tiny_config

DOCUMENTS = [[5, 6, 7], [1], [9, 9, 9, 9, 2], [3, 4]]
HEADER = 34  # magic 9 + version 8 + dtype 1 + count 8 + boundaries 8


def write(prefix: Path, documents=DOCUMENTS, dtype=np.uint16) -> Path:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for document in documents:
            writer.add_document(document)
    return prefix


def test_round_trip_and_layout(tmp_path):
    dataset = IndexedDataset(write(tmp_path / "d"))
    assert len(dataset) == 4 and dataset.num_tokens == 11 and dataset.dtype == np.uint16
    assert [dataset[i].tolist() for i in range(4)] == DOCUMENTS
    assert dataset.get(2, 1, 3).tolist() == [9, 9, 9]
    assert dataset.sizes.tolist() == [3, 1, 5, 2] and dataset.offsets.tolist() == [0, 6, 8, 18]
    assert dataset.document_bounds.tolist() == [0, 1, 2, 3, 4]
    assert isinstance(dataset.tokens, np.memmap)  # mapped, not read
    assert (tmp_path / "d.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"  # Megatron's format
    assert pickle.loads(pickle.dumps(dataset))[2].tolist() == DOCUMENTS[2]
    with pytest.raises(IndexError):
        dataset.get(0, 2, 5)
    with pytest.raises(DataError, match=r"d.bin.idx: file not found \(give the prefix, without .bin/.idx\)"):
        IndexedDataset(tmp_path / "d.bin")


def test_an_interrupted_writer_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "d", np.int32) as writer:
            writer.add_document([1, 2])
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _damage(tmp_path: Path, kind: str) -> str:
    """Damage a fresh dataset in one way; return the file the error must name."""
    write(tmp_path / "d")
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    n = len(DOCUMENTS)
    if kind == "missing idx":
        idx.unlink()
    elif kind == "missing bin":
        bin_.unlink()
    elif kind == "truncated header":
        idx.write_bytes(idx.read_bytes()[:20])
    elif kind == "bad magic":
        _patch(idx, 0, b"NOTANIDX\x00")
    elif kind == "bad version":
        _patch(idx, 9, struct.pack("<Q", 7))
    elif kind == "bad dtype":
        _patch(idx, 17, bytes([42]))
    elif kind == "float dtype":
        _patch(idx, 17, bytes([7]))
    elif kind == "truncated idx":
        idx.write_bytes(idx.read_bytes()[:-5])
    elif kind == "idx count too large":
        _patch(idx, 18, struct.pack("<Q", n + 1))
    elif kind == "truncated bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif kind == "trailing bytes in bin":
        bin_.write_bytes(bin_.read_bytes() + b"\x00\x00")
    elif kind == "offset past the end":
        _patch(idx, HEADER + 4 * n + 8 * 2, struct.pack("<q", 10_000))
    elif kind == "negative size":
        _patch(idx, HEADER + 4, struct.pack("<i", -1))
    elif kind == "offsets do not add up":
        _patch(idx, HEADER + 4 * n + 8 * 1, struct.pack("<q", 2))
    elif kind == "sizes do not add up":
        _patch(idx, HEADER, struct.pack("<i", 2))
    elif kind == "bad document bounds":
        _patch(idx, HEADER + 12 * n + 8 * n, struct.pack("<q", n - 1))
    else:
        raise AssertionError(kind)
    return str(bin_ if kind in ("missing bin", "truncated bin", "trailing bytes in bin", "sizes do not add up")
               else idx)


@pytest.mark.parametrize("kind, fragment", [
    ("missing idx", "file not found"), ("missing bin", "file not found"),
    ("truncated header", "truncated: 20 bytes, shorter than the 34-byte header"),
    ("bad magic", "not an index file"), ("bad version", "unsupported index version 7"),
    ("bad dtype", "unknown token dtype code 42"), ("float dtype", "not an integer type"),
    ("truncated idx", "truncated: 117 bytes, but its header (4 sequences, 5 document boundaries) needs 122"),
    ("idx count too large", "truncated"),
    ("truncated bin", "20 bytes, but the sizes in d.idx add up to 22 (truncated)"),
    ("trailing bytes in bin", "(trailing bytes)"),
    ("offset past the end", "sequence 2 spans bytes [10000, 10010), outside"),
    ("negative size", "sequence 1 has a negative length -1"),
    ("offsets do not add up", "sequence 1 starts at byte 2, but the sizes before it add up to 6"),
    ("sizes do not add up", "add up to 20 (trailing bytes)"),
    ("bad document bounds", "document boundaries do not rise from 0"),
])
def test_damaged_files_give_one_line_naming_the_file(tmp_path, kind, fragment):
    path = _damage(tmp_path, kind)
    with pytest.raises(DataError) as error:
        IndexedDataset(tmp_path / "d")
    message = str(error.value)
    assert message.startswith(f"{path}: ") and fragment in message and "\n" not in message


def test_tokens_outside_the_vocabulary(tmp_path):
    dataset = IndexedDataset(write(tmp_path / "d"))
    check_token_range(dataset, 10, tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*max-token.json"))) == 1  # the verdict is remembered
    with pytest.raises(DataError) as error:
        check_token_range(dataset, 9, tmp_path / "cache")  # the remembered max 9 is not < 9: rescanned
    assert str(error.value) == f"{tmp_path / 'd.bin'}: token 9 at position 4 is outside the tokenizer's " \
                               f"vocabulary [0, 9)"


def test_check_data_files_runs_every_check(tmp_path, corpus):
    cfg = tiny_config(data={"mock_data": False, "data_path": f"0.5 {corpus.prefix} 0.5 {tmp_path / 'd'}",
                            "tokenizer_model": str(corpus.tokenizer_model)})
    with pytest.raises(DataError, match="d.idx: file not found"):
        check_data_files(cfg)
    write(tmp_path / "d", [[1, 2, 3], [599, 600, 601]])  # the corpus's tokenizer has 601 pieces: 601 is outside
    with pytest.raises(DataError, match=r"d.bin: token 601 at position 5 is outside .* \[0, 601\)"):
        check_data_files(cfg)
    write(tmp_path / "d", [[1, 2, 3], [599, 600]])
    check_data_files(cfg)
    shutil.copy(corpus.tokenizer_model, tmp_path / "t.model")
    _patch(tmp_path / "t.model", 0, b"\xff\xff\xff\xff")
    cfg.data.tokenizer_model = str(tmp_path / "t.model")
    with pytest.raises(DataError, match="t.model: not a SentencePiece model"):
        check_data_files(cfg)
