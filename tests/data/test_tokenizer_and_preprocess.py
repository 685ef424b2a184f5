"""Tokenizers and preprocessing: exact round trips, blank input skipped, the tools' command lines; Hugging Face and
GPT-2 BPE tokenizers give the ids of transformers' AutoTokenizer (and of tiktoken, an independent BPE)."""

from __future__ import annotations

import importlib.util
import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from megalite.data import DataError
from megalite.data.documents import iter_documents
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.preprocess import preprocess
from megalite.config import TOKENIZER_TYPES
from megalite.data.tokenizer import (TOKENIZERS, GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer,
                                     SentencePieceTokenizer, build_tokenizer, tokenizer_from_files)

from .helpers import HF_VOCAB_SIZE, MULTILINGUAL, VOCAB_SIZE, generated_documents, write_jsonl

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


@pytest.mark.parametrize("lines, message", [
    (['{"text": "fine"}', '{"body": "x"}'], "docs.jsonl:2: no key 'text' (see --json-keys)"),   # the options wrong
    (['{not json', '{"text": "fine"}'], "docs.jsonl:1: not a JSON object (Expecting property name enclosed in double "
                                        "quotes); a .jsonl/.json input holds one JSON object per line"),
    (['[1]', '{"text": "fine"}'], "docs.jsonl:1: not a JSON object; a .jsonl/.json")])   # not JSON lines at all
def test_bad_json_lines_that_stop_name_the_line(tmp_path, lines, message):
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=re.escape(message)):
        list(iter_documents([str(tmp_path / "docs.jsonl")]))


def test_bad_json_records_are_skipped_each_named_and_counted(tmp_path, capsys):
    """A damaged record among good ones is skipped with a warning naming its file and line, and the summary counts
    them: a corrupt or cut line, a non-object, null or non-string text, a lone surrogate (valid JSON, but not text:
    it crashed the preprocessor with a traceback), nesting too deep, an integer too long for Python."""
    lines = ['{"text": "1 2"}', '{not json', '[3]', '{"text": null}', '{"text": 3}', '{"text": "4 \\ud800"}',
             '{"text": "5", "more": "6 \\udfff"}', "[" * 100_000, '{"text": 1' + "0" * 5000 + "}", '{"text": "7 8',
             '{"text": "9"}']
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "pair.jsonl").write_text('{"text": "\\ud83d\\ude00"}\n')   # a valid surrogate pair: one character
    assert list(iter_documents([str(tmp_path / "pair.jsonl")])) == ["\U0001F600"]
    documents = iter_documents([str(tmp_path / "docs.jsonl")], json_keys=["text", "more"])
    with pytest.raises(DataError, match="docs.jsonl:1: no key 'more'"):   # a missing key stops: the options are wrong
        list(documents)
    preprocess_tool = load_tool("preprocess_data")
    assert preprocess_tool.main(["--input", str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "out"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--quiet"]) == 0
    err = capsys.readouterr().err.splitlines()
    skipped = [line.split("docs.jsonl:")[1] for line in err if line.startswith("megalite: skipping ")]
    assert [s.split(":")[0] for s in skipped] == ["2", "3", "4", "5", "6", "8", "9", "10"], err
    assert skipped[2] == "4: 'text' is null, not a string" and skipped[3] == "5: 'text' is a int, not a string"
    assert skipped[4] == "6: 'text' holds a lone surrogate ('\\ud800'), which is not text"
    assert err[-1].startswith("wrote ") and "(8 bad records skipped, each named above)" in err[-1], err[-1]
    assert [IndexedDataset(tmp_path / "out")[i].tolist() for i in range(3)] == [[1, 2], [5], [9]]


def test_unwritable_outputs_are_one_line(tmp_path, capsys):
    """An output under a regular file (permissions do not stop root) is refused before any work, in one line."""
    (tmp_path / "file").write_text("")
    (tmp_path / "docs.txt").write_text("1 2\n")
    assert load_tool("preprocess_data").main(["--input", str(tmp_path / "docs.txt"), "--output-prefix",
                                              str(tmp_path / "file" / "out"), "--tokenizer-type", "NullTokenizer",
                                              "--vocab-size", "10"]) == 2
    assert load_tool("train_tokenizer").main(["--input", str(tmp_path / "docs.txt"), "--model-prefix",
                                              str(tmp_path / "file" / "tok")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"preprocess_data: error: {tmp_path}/file/out.bin: cannot be created: {tmp_path}/file is not a directory",
        f"train_tokenizer: error: {tmp_path}/file/tok.model: cannot be created: {tmp_path}/file is not a directory"]


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


def _library_tokenizers(directory: Path) -> tuple[HuggingFaceTokenizer, GPT2BPETokenizer]:
    return (build_tokenizer("HuggingFaceTokenizer", str(directory)),
            build_tokenizer("GPT2BPETokenizer", vocab_file=str(directory / "vocab.json"),
                            merge_file=str(directory / "merges.txt")))


def _tiktoken_ids(directory: Path, text: str) -> list[int]:
    """The ids of tiktoken (its own BPE, GPT-2's split pattern) with the ranks of vocab.json: a reference that shares
    no code with the tokenizers library."""
    tiktoken = pytest.importorskip("tiktoken")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(c): b for b, c in zip(printable + others, printable + [256 + i for i in range(len(others))])}
    vocab = json.loads((directory / "vocab.json").read_text())
    ranks = {bytes(byte_of[c] for c in token): i for token, i in vocab.items() if token != "<|endoftext|>"}
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""   # GPT-2's
    encoding = tiktoken.Encoding("tiny", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": vocab["<|endoftext|>"]})
    return encoding.encode(text, allowed_special="all")


def test_hugging_face_and_gpt2_bpe_ids_equal_transformers_and_tiktoken(hf_tokenizer_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf, gpt2 = _library_tokenizers(hf_tokenizer_dir)
    assert hf.vocab_size == gpt2.vocab_size == HF_VOCAB_SIZE and hf.eod == gpt2.eod == 0
    reference = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    # GPT-2's files as an export writes them (vocab.json, merges.txt, tokenizer_config.json), read by AutoTokenizer.
    (tmp_path / "gpt2").mkdir()
    for name, contents in gpt2.export_files().items():
        (tmp_path / "gpt2" / name).write_bytes(contents)
    gpt2_reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "gpt2")
    for text in [MULTILINGUAL, *generated_documents(10, seed=5)]:
        ids = reference.encode(text)
        assert hf.encode(text) == ids and gpt2.encode(text) == ids and gpt2_reference.encode(text) == ids
        assert _tiktoken_ids(hf_tokenizer_dir, text) == ids
        assert hf.decode(ids) == gpt2.decode(ids) == reference.decode(ids) == text
    assert hf.encode("a<|endoftext|>b")[1] == hf.eod   # the special token written out is one id


def test_the_post_processor_adds_special_tokens_as_transformers_does(hf_tokenizer_dir, tmp_path):
    """A tokenizer.json whose post-processor prepends a BOS (as Llama 3's does): the same ids as AutoTokenizer."""
    transformers = pytest.importorskip("transformers")
    shutil.copytree(hf_tokenizer_dir, tmp_path / "bos")
    spec = json.loads((tmp_path / "bos" / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>",
                                                                                        "type_id": 0}},
                                                                       {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B",
                                                                                               "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                   "tokens": ["<|endoftext|>"]}}}
    (tmp_path / "bos" / "tokenizer.json").write_text(json.dumps(spec))
    ids = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "bos")).encode(MULTILINGUAL)
    assert ids[0] == 0 and ids == transformers.AutoTokenizer.from_pretrained(tmp_path / "bos").encode(MULTILINGUAL)


def test_library_tokenizers_come_back_from_their_files_and_pickle(hf_tokenizer_dir):
    for tokenizer in _library_tokenizers(hf_tokenizer_dir):
        clone = tokenizer_from_files(type(tokenizer).__name__, tokenizer.files(), 0)
        assert clone.fingerprint() == tokenizer.fingerprint()
        assert clone.encode(MULTILINGUAL) == pickle.loads(pickle.dumps(tokenizer)).encode(MULTILINGUAL) == \
            tokenizer.encode(MULTILINGUAL)
    hf, gpt2 = _library_tokenizers(hf_tokenizer_dir)
    assert sorted(hf.files()) == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(gpt2.files()) == ["merges.txt", "vocab.json"] and hf.fingerprint() != gpt2.fingerprint()


def test_tokenizer_types_are_one_list_and_errors_are_one_line(hf_tokenizer_dir, tmp_path):
    assert set(TOKENIZERS) == set(TOKENIZER_TYPES)
    with pytest.raises(DataError, match="unknown tokenizer type 'WordPiece' .*HuggingFaceTokenizer, GPT2BPETokenizer"):
        build_tokenizer("WordPiece")
    with pytest.raises(DataError, match="no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    shutil.copy(hf_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="no end-of-document token: neither tokenizer_config.json nor"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    # A model's folder naming its EOS in config.json only (OpenAI's GPT-2): the tokenizer's files then say it too.
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "eos_token_id": 0}')
    tokenizer = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert tokenizer.eod == 0 and tokenizer_from_files("HuggingFaceTokenizer", tokenizer.files(), 0).eod == 0
    exported = tokenizer.export_files()   # AutoTokenizer told to read tokenizer.json as it is
    assert json.loads(exported["tokenizer_config.json"]) == {"tokenizer_class": "PreTrainedTokenizerFast"}
    assert json.loads(exported["special_tokens_map.json"]) == {"eos_token": "<|endoftext|>"}
    (tmp_path / "config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|end|>"}')
    with pytest.raises(DataError, match="the end-of-document token '<\\|end\\|>' is not in the vocabulary"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(DataError, match="merges.txt line 2 is not two tokens"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(hf_tokenizer_dir / "vocab.json"),
                        merge_file=str(tmp_path / "merges.txt"))
    with pytest.raises(DataError, match="GPT2BPETokenizer needs --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(hf_tokenizer_dir / "vocab.json"))
    with pytest.raises(DataError, match="missing.json: GPT-2 BPE vocab.json not found"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"),
                        merge_file=str(tmp_path / "merges.txt"))


@pytest.mark.parametrize("tokenizer_type", ["HuggingFaceTokenizer", "GPT2BPETokenizer"])
def test_preprocess_data_with_hugging_face_tokenizers(hf_tokenizer_dir, tmp_path, tokenizer_type):
    documents = generated_documents(30, seed=4) + [MULTILINGUAL]
    write_jsonl(tmp_path / "docs.jsonl", documents)
    options = (["--tokenizer-model", str(hf_tokenizer_dir)] if tokenizer_type == "HuggingFaceTokenizer" else
               ["--vocab-file", str(hf_tokenizer_dir / "vocab.json"), "--merge-file",
                str(hf_tokenizer_dir / "merges.txt")])
    assert load_tool("preprocess_data").main(["--input", str(tmp_path / "docs.jsonl"), "--output-prefix",
                                              str(tmp_path / "out"), "--tokenizer-type", tokenizer_type, *options,
                                              "--workers", "2", "--append-eod", "--quiet"]) == 0
    dataset, tokenizer = IndexedDataset(tmp_path / "out"), _library_tokenizers(hf_tokenizer_dir)[0]
    assert [tokenizer.decode(dataset[i][:-1].tolist()) for i in range(len(dataset))] == documents
    assert {int(dataset[i][-1]) for i in range(len(dataset))} == {tokenizer.eod}


def test_auto_map_is_dropped_from_a_hugging_face_tokenizer(hf_tokenizer_dir, tmp_path):
    """tokenizer_config.json's auto_map names code of the model's repository that transformers would run with
    trust_remote_code; megalite never runs it, so it is dropped as the directory is read (nothing carries it into a
    checkpoint) and from the files an export writes (a checkpoint saved before holds it)."""
    shutil.copytree(hf_tokenizer_dir, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": ["evil--tokenization.EvilTokenizer", None]}, tokenizer_class="Evil")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    read = HuggingFaceTokenizer.from_directory(tmp_path / "hf")
    old = tokenizer_from_files("HuggingFaceTokenizer", {**read.files(), "tokenizer_config.json":
                                                        json.dumps(config).encode()}, read.vocab_size)
    for files in (read.files(), read.export_files(), old.export_files()):
        written = json.loads(files["tokenizer_config.json"])
        assert "auto_map" not in written and written["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert written["eos_token"] == config["eos_token"]
