"""Megatron's tokenizer names: GPTSentencePieceTokenizer and Llama2Tokenizer on SentencePiece models (Llama's adds
BOS), TikTokenizer on a tiktoken BPE file (special ids first, Megatron's two pre-tokenization patterns)."""

from __future__ import annotations

import base64
import json
import pickle

import pytest

from megalite.data import DataError
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.preprocess import preprocess
from megalite.data.tokenizer import (GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer,
                                     TikTokenizer, build_tokenizer)

tiktoken = pytest.importorskip("tiktoken")

MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"oW"]


def write_vocabulary(path, merges=MERGES) -> None:
    """A tiktoken vocabulary in Megatron's JSON format: the 256 bytes, then the merged tokens."""
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("utf-8", "replace")} for i, t in enumerate(tokens)]))


def test_sentencepiece_names(corpus):
    plain, gpt = corpus.tokenizer, GPTSentencePieceTokenizer(corpus.tokenizer_model)
    llama = Llama2Tokenizer(corpus.tokenizer_model)
    text = corpus.documents[3]
    assert gpt.encode(text) == plain.encode(text) and gpt.eod == plain.eod
    bos = llama._sp.bos_id()
    assert bos >= 0 and llama.encode(text) == [bos, *plain.encode(text)] and llama.eod == plain.eod
    assert llama.decode(llama.encode(text)) == text
    assert isinstance(build_tokenizer("Llama2Tokenizer", str(corpus.tokenizer_model), 0), Llama2Tokenizer)
    with pytest.raises(DataError, match="Llama2Tokenizer needs --tokenizer-model"):
        build_tokenizer("Llama2Tokenizer", None, 0)
    assert type(pickle.loads(pickle.dumps(llama))) is Llama2Tokenizer


def test_tiktokenizer_ids_special_tokens_and_round_trips(tmp_path):
    path = tmp_path / "tokenizer.json"
    write_vocabulary(path)
    tokenizer = TikTokenizer(path, "v2")
    special = 1000
    assert tokenizer.vocab_size == special + 256 + len(MERGES) and tokenizer.eod == 2   # <unk> <s> </s> ...
    assert tokenizer.encode("hello world") == [special + 256 + MERGES.index(b"hello"),
                                               special + 256 + MERGES.index(b" world")]
    assert tokenizer.encode("A") == [special + ord("A")]
    for text in ["hello world", "naïve 漢字 🦊\n\ttabs", "</s> is plain text here", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eod not in tokenizer.encode("</s>")   # special tokens' spellings are plain text
    # Fewer or other special tokens move the BPE ranks down; the required three keep their ids.
    small = build_tokenizer("TikTokenizer", str(path), 0, tiktoken_pattern="v2", tiktoken_num_special_tokens=8,
                            tiktoken_special_tokens="<unk> <s> </s> <pad>")
    assert small.encode("A") == [8 + ord("A")] and small.eod == 2 and small.vocab_size == 8 + 256 + len(MERGES)
    clone = pickle.loads(pickle.dumps(small))
    assert clone.encode("hello world") == small.encode("hello world") and clone.vocab_size == small.vocab_size
    assert sorted(clone.files()) == ["tiktoken.json", "tiktoken_options.json"]   # the options travel with the ranks
    assert clone.files()["tiktoken.json"] == path.read_bytes()


def test_tiktoken_patterns_split_words_differently(tmp_path):
    """v1 keeps a run of letters together; v2 (Megatron's) splits it where lower case turns upper: the merge "oW"
    inside "HelloWorld" happens only with v1."""
    path = tmp_path / "tokenizer.json"
    write_vocabulary(path)
    merged = 1000 + 256 + MERGES.index(b"oW")
    assert merged in TikTokenizer(path, "v1").encode("HelloWorld")
    assert merged not in TikTokenizer(path, "v2").encode("HelloWorld")


@pytest.mark.parametrize("contents, message", [
    (None, "tokenizer file not found"),
    ("not json", "not a TikTokenizer vocabulary"),
    (json.dumps([{"rank": 1, "token_bytes": "AA==", "token_str": ""}]), "ranks must be 0, 1, 2, ... in order"),
    (json.dumps([{"rank": 0, "token_bytes": "AQ==", "token_str": ""}]), "ranks 0-255 must be the 256 single bytes"),
])
def test_bad_tiktoken_files_are_one_line_errors(tmp_path, contents, message):
    path = tmp_path / "tokenizer.json"
    if contents is not None:
        path.write_text(contents)
    with pytest.raises(DataError, match=message):
        TikTokenizer(path, "v2")


def test_bad_tiktoken_options(tmp_path):
    path = tmp_path / "tokenizer.json"
    write_vocabulary(path)
    with pytest.raises(DataError, match="TikTokenizer needs --tiktoken-pattern"):
        build_tokenizer("TikTokenizer", str(path), 0)
    with pytest.raises(DataError, match="must be unique, at most 2 .* and include <unk>, <s>, </s>"):
        TikTokenizer(path, "v1", num_special_tokens=2)


def test_preprocess_with_tiktokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    write_vocabulary(path)
    tokenizer = TikTokenizer(path, "v2")
    preprocess(["hello world", "A hello"], tokenizer, tmp_path / "docs", workers=1, append_eod=True, progress=None)
    dataset = IndexedDataset(tmp_path / "docs")
    assert [list(dataset[i]) for i in range(2)] == [tokenizer.encode("hello world") + [2],
                                                     tokenizer.encode("A hello") + [2]]
    assert not isinstance(tokenizer, SentencePieceTokenizer)
