"""Tokenizer training and preprocessing: exact round trips, blank input skipped, the tools' command lines."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest

from megalite.data import DataError
from megalite.data.documents import iter_documents
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.preprocess import preprocess
from megalite.data.tokenizer import NullTokenizer, SentencePieceTokenizer, build_tokenizer

from .helpers import VOCAB_SIZE, generated_documents

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_encode_is_identity(corpus):
    tokenizer = corpus.tokenizer
    assert tokenizer.vocab_size == VOCAB_SIZE and tokenizer.eod == 2
    unseen = ["  leading and trailing  ", "\n\nblank lines\n\n", "tabs\tand\r\nCRLF", "控制 \x00 \x7f emoji 🦊",
              "    def f(x):\n        return x  # indented\n"]
    for text in corpus.documents + unseen:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    # A pickled tokenizer (what the preprocessing workers receive) carries the model itself.
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode(unseen[-1]) == tokenizer.encode(unseen[-1])


def test_preprocessed_documents_decode_to_the_input(corpus):
    dataset = IndexedDataset(corpus.prefix)
    tokenizer = corpus.tokenizer
    assert dataset.dtype == np.uint16
    assert len(dataset) == len(corpus.documents)  # the empty lines and documents were skipped
    for i, text in enumerate(corpus.documents):
        tokens = dataset[i]
        assert tokens[-1] == tokenizer.eod
        assert tokenizer.decode(tokens[:-1].tolist()) == text
    assert dataset.num_tokens == int(dataset.sizes.sum())


def test_workers_do_not_change_the_output(corpus, tmp_path):
    stats = preprocess(iter_documents([str(corpus.jsonl)]), corpus.tokenizer, tmp_path / "two", workers=2,
                       append_eod=True, progress=None)
    assert stats.documents == len(corpus.documents)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"two{suffix}").read_bytes() == Path(f"{corpus.prefix}{suffix}").read_bytes()


def test_large_vocabularies_use_int32(tmp_path):
    documents = ["1 2 3", "69999 0", "   ", "5", ""]
    stats = preprocess(documents, NullTokenizer(70000), tmp_path / "wide", append_eod=True, progress=None)
    dataset = IndexedDataset(tmp_path / "wide")
    assert dataset.dtype == np.int32 and stats.documents == 3 and stats.skipped == 2
    assert [dataset[i].tolist() for i in range(3)] == [[1, 2, 3, 69999], [69999, 0, 69999], [5, 69999]]


def test_blank_documents_are_skipped_by_the_preprocessor(corpus, tmp_path):
    stats = preprocess(["a b", " \n\t ", "", "c"], corpus.tokenizer, tmp_path / "p", progress=None)
    assert (stats.documents, stats.skipped) == (2, 2)


def test_plain_text_inputs_and_directories(tmp_path):
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    (tmp_path / "dir" / "a.txt").write_text("first line\n\n  \nsecond line\r\n")
    (tmp_path / "dir" / "sub" / "b.py").write_text("def f():\n    pass\n")
    (tmp_path / "dir" / ".hidden").write_text("never read\n")
    (tmp_path / "dir" / "blob.bin").write_bytes(b"\xff\xfe\x00binary")  # not text: skipped while walking
    assert list(iter_documents([str(tmp_path / "dir")])) == ["first line", "second line", "def f():", "    pass"]
    assert list(iter_documents([str(tmp_path / "dir" / "sub")], whole_files=True)) == ["def f():\n    pass\n"]
    with pytest.raises(DataError, match="blob.bin:1: not UTF-8 text"):
        list(iter_documents([str(tmp_path / "dir" / "blob.bin")]))


@pytest.mark.parametrize("line, message", [("{not json", "docs.jsonl:2: not a JSON object"),
                                           ('{"body": "x"}', "docs.jsonl:2: no key 'text'"),
                                           ('{"text": 3}', "docs.jsonl:2: 'text' is a int, not a string")])
def test_bad_json_lines_name_the_line(tmp_path, line, message):
    (tmp_path / "docs.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        list(iter_documents([str(tmp_path / "docs.jsonl")]))


def test_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="missing.model: tokenizer model not found"):
        SentencePieceTokenizer(tmp_path / "missing.model")
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match="bad.model: not a SentencePiece model") as error:
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "bad.model"), 0)
    assert "\n" not in str(error.value)
    assert NullTokenizer(10).encode("3 9") == [3, 9] and NullTokenizer(10).eod == 9


def test_tools_end_to_end(tmp_path, capsys):
    documents = generated_documents(120, seed=3)
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    for i, document in enumerate(documents):
        (text_dir / f"{i:03d}.txt").write_text(document)
    train = load_tool("train_tokenizer")
    assert train.main(["--input", str(text_dir), "--model-prefix", str(tmp_path / "tok"), "--vocab-size", "500",
                       "--num-threads", "1"]) == 0
    assert (tmp_path / "tok.model").is_file() and (tmp_path / "tok.vocab").is_file()
    preprocess_tool = load_tool("preprocess_data")
    assert preprocess_tool.main(["--input", str(text_dir), "--whole-files", "--output-prefix", str(tmp_path / "out"),
                                 "--tokenizer-model", str(tmp_path / "tok.model"), "--workers", "2",
                                 "--append-eod"]) == 0
    err = capsys.readouterr().err   # not a terminal: no bar, the summary only
    assert "tokenizing:" not in err and "tokens/s" in err and f"{len(documents)} documents" in err
    dataset, tokenizer = IndexedDataset(tmp_path / "out"), SentencePieceTokenizer(tmp_path / "tok.model")
    assert [tokenizer.decode(dataset[i][:-1].tolist()) for i in range(len(dataset))] == documents
    # Errors are one line and exit code 2.
    assert train.main(["--input", str(tmp_path / "none"), "--model-prefix", str(tmp_path / "x")]) == 2
    assert preprocess_tool.main(["--input", str(text_dir), "--output-prefix", str(tmp_path / "y"),
                                 "--tokenizer-model", str(tmp_path / "none.model")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"train_tokenizer: error: {tmp_path / 'none'}: input not found",
                   f"preprocess_data: error: {tmp_path / 'none.model'}: tokenizer model not found"]
