"""Tokenizers: text <-> token ids, plus the vocabulary size and end-of-document (EOD) id the data layer needs.

One class per ``--tokenizer-type`` (Megatron's names), found by name in :data:`TOKENIZERS`:

- ``SentencePieceTokenizer``: a SentencePiece model (``--tokenizer-model FILE``).
- ``HuggingFaceTokenizer``: a Hugging Face fast tokenizer (``--tokenizer-model DIR`` holding ``tokenizer.json``, and
  ``tokenizer_config.json`` naming the EOS token, which is the EOD), run offline by the ``tokenizers`` library:
  the ids of ``transformers.AutoTokenizer.from_pretrained(DIR).encode(text)`` (special tokens such as a BOS added as
  its post-processor says). An ``auto_map`` in tokenizer_config.json (Python code of the model's repository, which
  transformers would run with ``trust_remote_code``) is dropped as the directory is read, and never exported:
  megalite runs tokenizer.json as it is, never that code, so the class named is ``PreTrainedTokenizerFast``.
- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file vocab.json --merge-file merges.txt``, run by the
  ``tokenizers`` library as transformers' GPT2Tokenizer runs it; EOD is ``<|endoftext|>``.
- ``NullTokenizer``: text that already is space-separated token ids (pre-tokenized or mock data), with ids below
  ``vocab_size`` and EOD = ``vocab_size - 1``.
- Megatron's other names (the end of this module): ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer`` (SentencePiece
  models; Llama2's documents start with its BOS) and ``TikTokenizer`` (a tiktoken BPE file, ``--tiktoken-pattern``).

A tokenizer is defined by its type and :meth:`Tokenizer.files`: a checkpoint stores both, and
:func:`tokenizer_from_files` rebuilds it; :meth:`Tokenizer.options_for` are the data options naming such files in a
directory (a run that trains on with a checkpoint's tokenizer). :meth:`Tokenizer.export_files` are the files that let
transformers' ``AutoTokenizer`` load it (written beside an exported model).

:func:`train_sentencepiece` trains models for which ``decode(encode(x)) == x`` for any text: identity normalization
(no NFKC), whitespace kept as it is (runs of spaces may become one piece, so indentation is cheap), the newline a piece
of its own (training reads lines, so it would never see one otherwise) and byte fallback, so no character is unknown.
"""

from __future__ import annotations

import abc
import base64
import binascii
import dataclasses
import hashlib
import io
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Optional

import sentencepiece as spm

from megalite.config import TOKENIZER_TYPES, DataConfig
from megalite.data.atomic import write_atomically
from megalite.data.errors import DataError


@dataclasses.dataclass(frozen=True)
class TokenizerOptions:
    """What the command line says about a tokenizer (Megatron's flags); each type reads the options it needs."""
    model: Optional[str] = None        # --tokenizer-model
    vocab_file: Optional[str] = None   # --vocab-file
    merge_file: Optional[str] = None   # --merge-file
    vocab_size: int = 0                # the model's vocabulary (NullTokenizer's size)
    tiktoken_pattern: Optional[str] = None        # --tiktoken-pattern (TikTokenizer)
    tiktoken_num_special_tokens: int = 1000       # --tiktoken-num-special-tokens
    tiktoken_special_tokens: Optional[str] = None  # --tiktoken-special-tokens, space-separated

    @classmethod
    def of(cls, data: DataConfig, vocab_size: int) -> TokenizerOptions:
        return cls(data.tokenizer_model, data.vocab_file, data.merge_file, vocab_size, data.tiktoken_pattern,
                   data.tiktoken_num_special_tokens, data.tiktoken_special_tokens)

    def data_options(self) -> dict[str, Optional[str]]:
        """These options as DataConfig fields."""
        return {"tokenizer_model": self.model, "vocab_file": self.vocab_file, "merge_file": self.merge_file,
                "tiktoken_pattern": self.tiktoken_pattern,
                "tiktoken_num_special_tokens": self.tiktoken_num_special_tokens,
                "tiktoken_special_tokens": self.tiktoken_special_tokens}


class Tokenizer(abc.ABC):
    """What the data layer needs of a tokenizer."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (every id is in [0, vocab_size))."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """The id appended after each document (--append-eod)."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    @classmethod
    @abc.abstractmethod
    def from_options(cls, options: TokenizerOptions) -> Tokenizer:
        """The tokenizer the command-line options name (files are read here)."""

    @classmethod
    @abc.abstractmethod
    def from_files(cls, files: dict[str, bytes], vocab_size: int) -> Tokenizer:
        """The tokenizer whose :meth:`files` are ``files`` and whose vocabulary size was ``vocab_size``."""

    def files(self) -> dict[str, bytes]:
        """The files that define this tokenizer (file name -> contents): what a checkpoint stores beside the weights
        and an export writes next to them. Empty for a tokenizer defined by its parameters alone."""
        return {}

    @classmethod
    @abc.abstractmethod
    def options_for(cls, directory: Path) -> TokenizerOptions:
        """The options of this tokenizer type naming the files of :meth:`files` written into ``directory``."""

    def export_files(self) -> dict[str, bytes]:
        """Files with which ``transformers.AutoTokenizer.from_pretrained`` loads this tokenizer, giving the same ids;
        empty when it cannot."""
        return {}

    def fingerprint(self) -> str:
        """A digest of what decides the token ids (type, files, vocabulary size, EOD): two tokenizers with the same
        fingerprint map every text to the same ids."""
        digest = hashlib.sha256(f"{type(self).__name__}:{self.vocab_size}:{self.eod}".encode())
        for name, contents in sorted(self.files().items()):
            digest.update(f"\0{name}\0{len(contents)}\0".encode())
            digest.update(contents)
        return digest.hexdigest()


def _sentencepiece_message(error: Exception) -> str:
    """SentencePiece's reason without its source location: 'INTERNAL: src/x.cc(744) [cond] Reason.' -> 'Reason.'"""
    text = " ".join(str(error).split())
    return re.sub(r"^[A-Z_]+: (src/\S+\(\d+\) \[.*?\] ?)?", "", text) or text


def _required(files: dict[str, bytes], name: str, kind: str) -> bytes:
    if name not in files:
        raise DataError(f"{kind}: no {name} among its files ({', '.join(sorted(files)) or 'none'})")
    return files[name]


SENTENCEPIECE_FILE = "tokenizer.model"


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_path: str | os.PathLike):
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"{self.model_path}: tokenizer model not found")
        self._load(self.model_path.read_bytes())

    def _load(self, proto: bytes) -> None:
        self._proto = proto
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(proto)
        except RuntimeError as error:
            message = _sentencepiece_message(error) or "cannot parse it"
            raise DataError(f"{self.model_path}: not a SentencePiece model ({message})") from None
        if self._sp.eos_id() < 0:
            raise DataError(f"{self.model_path}: the model has no end-of-document piece (eos_id -1)")

    @classmethod
    def from_options(cls, options: TokenizerOptions) -> SentencePieceTokenizer:
        if options.model is None:
            raise DataError(f"{cls.__name__} needs --tokenizer-model")
        return cls(options.model)

    @classmethod
    def options_for(cls, directory: Path) -> TokenizerOptions:
        return TokenizerOptions(model=str(directory / SENTENCEPIECE_FILE))

    @classmethod
    def from_files(cls, files: dict[str, bytes], vocab_size: int) -> SentencePieceTokenizer:
        tokenizer = cls.__new__(cls)
        tokenizer.model_path = Path(SENTENCEPIECE_FILE)
        tokenizer._load(_required(files, SENTENCEPIECE_FILE, cls.__name__))
        return tokenizer

    # Worker processes of the preprocessor receive the model itself, not a path they might not see.
    def __getstate__(self) -> dict:
        return {"model_path": str(self.model_path), "proto": self._proto}

    def __setstate__(self, state: dict) -> None:
        self.model_path = Path(state["model_path"])
        self._load(state["proto"])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def files(self) -> dict[str, bytes]:
        return {SENTENCEPIECE_FILE: self._proto}

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class NullTokenizer(Tokenizer):
    """Text is token ids separated by whitespace; EOD is the last id."""

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise DataError(f"NullTokenizer needs a vocabulary of at least 2 ids, got {vocab_size}")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError as error:
            raise DataError(f"NullTokenizer: text must be token ids ({error})") from None
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise DataError(f"NullTokenizer: token id {bad[0]} is outside [0, {self._vocab_size})")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @classmethod
    def from_options(cls, options: TokenizerOptions) -> NullTokenizer:
        return cls(options.vocab_size)

    @classmethod
    def from_files(cls, files: dict[str, bytes], vocab_size: int) -> NullTokenizer:
        return cls(vocab_size)

    @classmethod
    def options_for(cls, directory: Path) -> TokenizerOptions:
        return TokenizerOptions()


def _library_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("HuggingFaceTokenizer and GPT2BPETokenizer need the tokenizers package: "
                        "pip install tokenizers") from None
    return tokenizers


def _read_json(contents: bytes, where: str) -> dict:
    try:
        data = json.loads(contents)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{where}: not JSON ({error})") from None
    if not isinstance(data, dict):
        raise DataError(f"{where}: not a JSON object")
    return data


class _LibraryTokenizer(Tokenizer):
    """A tokenizer run by the ``tokenizers`` library, defined by its files; pickled as them (preprocessing
    workers)."""

    def __init__(self, files: dict[str, bytes], where: Optional[str] = None):
        self._files, self._where = dict(files), where or type(self).__name__
        self._tokenizer, eod_token = self._build(self._files)
        self._eod = self._tokenizer.token_to_id(eod_token)
        if self._eod is None:
            raise DataError(f"{self._where}: the end-of-document token {eod_token!r} is not in the vocabulary")

    @abc.abstractmethod
    def _build(self, files: dict[str, bytes]):
        """The ``tokenizers.Tokenizer`` of the files and the text of its EOD token."""

    @classmethod
    def from_files(cls, files: dict[str, bytes], vocab_size: int) -> _LibraryTokenizer:
        return cls(files)

    def __reduce__(self):
        return type(self), (self._files, self._where)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS = "special_tokens_map.json"
HF_CHAT_TEMPLATE = "chat_template.jinja"   # where transformers 5 saves the chat template


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _named_eos(files: dict[str, bytes], where: str) -> Optional[str]:
    """The EOS token that tokenizer_config.json (or else special_tokens_map.json) names, None if neither does."""
    for name in (HF_TOKENIZER_CONFIG, HF_SPECIAL_TOKENS):
        if name in files:
            eos = _token_text(_read_json(files[name], f"{where}/{name}").get("eos_token"))
            if eos:
                return eos
    return None


def _without_remote_code(config_file: bytes, where: str) -> bytes:
    """tokenizer_config.json without its ``auto_map`` (code megalite never runs, which would otherwise travel into
    checkpoints and exports), naming the class that reads tokenizer.json as it is instead of the custom one."""
    config = _read_json(config_file, where)
    if "auto_map" not in config:
        return config_file
    del config["auto_map"]
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return (json.dumps(config, indent=2) + "\n").encode()


def _parse_tokenizer_json(contents: bytes, where: str):
    try:
        return _library_tokenizers().Tokenizer.from_str(contents.decode())
    except Exception as error:   # the library raises a bare Exception on a malformed file
        raise DataError(f"{where}: not a Hugging Face {HF_TOKENIZER_FILE} ({error})") from None


class HuggingFaceTokenizer(_LibraryTokenizer):
    FILES = (HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG, HF_SPECIAL_TOKENS, HF_CHAT_TEMPLATE)   # read when present

    @classmethod
    def from_options(cls, options: TokenizerOptions) -> HuggingFaceTokenizer:
        if options.model is None:
            raise DataError("HuggingFaceTokenizer needs --tokenizer-model (a directory with tokenizer.json)")
        return cls.from_directory(options.model)

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> HuggingFaceTokenizer:
        folder, where = Path(directory), str(directory)
        if not (folder / HF_TOKENIZER_FILE).is_file():
            raise DataError(f"{folder}: no {HF_TOKENIZER_FILE} (a Hugging Face tokenizer's directory)")
        files = {name: (folder / name).read_bytes() for name in cls.FILES if (folder / name).is_file()}
        if HF_TOKENIZER_CONFIG in files:
            files[HF_TOKENIZER_CONFIG] = _without_remote_code(files[HF_TOKENIZER_CONFIG],
                                                              f"{where}/{HF_TOKENIZER_CONFIG}")
        if _named_eos(files, where) is None and (folder / "config.json").is_file():
            # A model's folder may name its EOS in config.json only (OpenAI's GPT-2): kept as special_tokens_map.json,
            # the file transformers writes it to, so that the tokenizer's files say it.
            eos_id = _read_json((folder / "config.json").read_bytes(), f"{where}/config.json").get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
            token = (_parse_tokenizer_json(files[HF_TOKENIZER_FILE], where).id_to_token(eos_id)
                     if isinstance(eos_id, int) else None)
            if token is not None:
                files[HF_SPECIAL_TOKENS] = (json.dumps({"eos_token": token}, indent=2) + "\n").encode()
        return cls(files, where)

    @classmethod
    def options_for(cls, directory: Path) -> TokenizerOptions:
        return TokenizerOptions(model=str(directory))

    def _build(self, files: dict[str, bytes]):
        tokenizer = _parse_tokenizer_json(_required(files, HF_TOKENIZER_FILE, self._where), self._where)
        eos = _named_eos(files, self._where)
        if eos is None:
            raise DataError(f"{self._where}: no end-of-document token: neither {HF_TOKENIZER_CONFIG} nor "
                            f"{HF_SPECIAL_TOKENS} (nor a model's config.json beside them) names an eos_token")
        return tokenizer, eos

    def export_files(self) -> dict[str, bytes]:
        """Its files; tokenizer_config.json names the class that reads tokenizer.json as it is (without one,
        AutoTokenizer would pick the model type's class, which may build the tokenizer its own way)."""
        files = self.files()
        if HF_TOKENIZER_CONFIG in files:   # a checkpoint saved before auto_map was dropped on reading may hold one
            files[HF_TOKENIZER_CONFIG] = _without_remote_code(files[HF_TOKENIZER_CONFIG], self._where)
        config = _read_json(files[HF_TOKENIZER_CONFIG], self._where) if HF_TOKENIZER_CONFIG in files else {}
        if "tokenizer_class" not in config:
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            files[HF_TOKENIZER_CONFIG] = (json.dumps(config, indent=2) + "\n").encode()
        return files


GPT2_VOCAB_FILE, GPT2_MERGE_FILE = "vocab.json", "merges.txt"
GPT2_EOD = "<|endoftext|>"


class GPT2BPETokenizer(_LibraryTokenizer):
    @classmethod
    def from_options(cls, options: TokenizerOptions) -> GPT2BPETokenizer:
        if options.vocab_file is None or options.merge_file is None:
            raise DataError("GPT2BPETokenizer needs --vocab-file and --merge-file")
        files = {}
        for name, path in ((GPT2_VOCAB_FILE, options.vocab_file), (GPT2_MERGE_FILE, options.merge_file)):
            if not Path(path).is_file():
                raise DataError(f"{path}: GPT-2 BPE {name} not found")
            files[name] = Path(path).read_bytes()
        return cls(files, options.vocab_file)

    @classmethod
    def options_for(cls, directory: Path) -> TokenizerOptions:
        return TokenizerOptions(vocab_file=str(directory / GPT2_VOCAB_FILE),
                                merge_file=str(directory / GPT2_MERGE_FILE))

    def _build(self, files: dict[str, bytes]):
        library = _library_tokenizers()
        vocab = _read_json(_required(files, GPT2_VOCAB_FILE, self._where), f"{self._where} ({GPT2_VOCAB_FILE})")
        merges = []
        try:
            lines = _required(files, GPT2_MERGE_FILE, self._where).decode().splitlines()
        except UnicodeDecodeError as error:
            raise DataError(f"{self._where}: {GPT2_MERGE_FILE} is not text ({error})") from None
        for number, line in enumerate(lines, 1):
            if not line or line.startswith("#version"):
                continue
            pair = line.split(" ")
            if len(pair) != 2:
                raise DataError(f"{self._where}: {GPT2_MERGE_FILE} line {number} is not two tokens: {line!r}")
            merges.append(tuple(pair))
        try:
            tokenizer = library.Tokenizer(library.models.BPE(vocab, merges, continuing_subword_prefix="",
                                                             end_of_word_suffix="", fuse_unk=False))
        except Exception as error:   # e.g. a merge of tokens the vocabulary lacks
            raise DataError(f"{self._where}: not a GPT-2 BPE vocabulary and merges ({error})") from None
        tokenizer.pre_tokenizer = library.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = library.decoders.ByteLevel()
        tokenizer.add_special_tokens([library.AddedToken(GPT2_EOD, special=True)])   # as GPT2Tokenizer's eos
        return tokenizer, GPT2_EOD

    def export_files(self) -> dict[str, bytes]:
        config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": GPT2_EOD,
                  "eos_token": GPT2_EOD, "unk_token": GPT2_EOD}
        return {**self.files(), HF_TOKENIZER_CONFIG: (json.dumps(config, indent=2) + "\n").encode()}

# ---- Megatron's tokenizer names ----------------------------------------------------------------------------------
# --tokenizer-type Llama2Tokenizer | GPTSentencePieceTokenizer (SentencePiece models) | TikTokenizer (a tiktoken BPE
# file), as Megatron-LM's megatron/training/tokenizer builds them: same ids for the same files.

class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's GPTSentencePieceTokenizer: the model's own pieces, EOD = its end-of-sentence id (this module's
    SentencePieceTokenizer under Megatron's name)."""


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: a Llama SentencePiece model; every document starts with the model's BOS id
    (Megatron's text-completion default), EOD = its EOS id."""

    def _load(self, proto: bytes) -> None:
        super()._load(proto)
        if self._sp.bos_id() < 0:
            raise DataError(f"{self.model_path}: Llama2Tokenizer needs a model with a beginning-of-sentence piece "
                            f"(bos_id is -1)")

    def encode(self, text: str) -> list[int]:
        return [self._sp.bos_id(), *self._sp.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) != self._sp.bos_id()])


# Megatron's two pre-tokenization patterns for TikTokenizer (--tiktoken-pattern v1 | v2), as its tokenizer has them.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TIKTOKEN_REQUIRED_SPECIAL = ("<unk>", "<s>", "</s>")
# A TikTokenizer's files: the BPE vocabulary, and the options that give its ids (pattern and special tokens).
TIKTOKEN_FILE, TIKTOKEN_OPTIONS_FILE = "tiktoken.json", "tiktoken_options.json"


class TikTokenizer(Tokenizer):
    """Megatron's TikTokenizer: byte-level BPE from a JSON file (a list of {"rank", "token_bytes" (base64),
    "token_str"}, rank i at index i, the 256 single bytes first) through the tiktoken package, local files only.

    Ids 0 .. num_special_tokens - 1 are the special tokens (``special_tokens``, which must include <unk>, <s> and
    </s>, then <SPECIAL_i> fillers); BPE rank r is id num_special_tokens + r; EOD is </s>. Text is encoded as plain
    text (special tokens' spellings are not parsed). The vocabulary is every rank of the file after the special ids:
    Megatron cuts the file to --vocab-size (default 2^17) and needs it to fill that, so the two agree whenever
    Megatron accepts the file.
    """

    def __init__(self, path: str | os.PathLike, pattern: str = "v2", num_special_tokens: int = 1000,
                 special_tokens: Sequence[str] | None = None, contents: bytes | None = None):
        try:
            import tiktoken   # optional: pip install 'megalite[tiktoken]'
        except ImportError:
            raise DataError("TikTokenizer needs the tiktoken package: pip install tiktoken") from None
        self.path = Path(path)
        if pattern not in TIKTOKEN_PATTERNS:
            raise DataError(f"TikTokenizer: pattern must be {' or '.join(TIKTOKEN_PATTERNS)}, got {pattern!r}")
        names = list(special_tokens) if special_tokens is not None else list(TIKTOKEN_REQUIRED_SPECIAL)
        missing = [t for t in TIKTOKEN_REQUIRED_SPECIAL if t not in names]
        if missing or len(set(names)) != len(names) or len(names) > num_special_tokens:
            raise DataError(f"TikTokenizer: special tokens {names} must be unique, at most {num_special_tokens} "
                            f"(--tiktoken-num-special-tokens), and include {', '.join(TIKTOKEN_REQUIRED_SPECIAL)}")
        names += [f"<SPECIAL_{i}>" for i in range(len(names), num_special_tokens)]
        if contents is None and not self.path.is_file():
            raise DataError(f"{self.path}: tokenizer file not found")
        self._contents = self.path.read_bytes() if contents is None else contents
        ranks = self._ranks(self._contents)
        self._special = {name: i for i, name in enumerate(names)}
        self._pattern, self._num_special = pattern, num_special_tokens
        self._model = tiktoken.Encoding(name=f"megalite-{self.path.stem}", pat_str=TIKTOKEN_PATTERNS[pattern],
                                        mergeable_ranks={b: r + num_special_tokens for b, r in ranks.items()},
                                        special_tokens=self._special)
        self._vocab_size = num_special_tokens + len(ranks)

    def _ranks(self, contents: bytes) -> dict[bytes, int]:
        try:
            entries = json.loads(contents)
            ranks = {base64.b64decode(e["token_bytes"], validate=True): e["rank"] for e in entries}
            ordered = all(e["rank"] == i for i, e in enumerate(entries))
        except (ValueError, TypeError, KeyError, binascii.Error) as error:
            raise DataError(f"{self.path}: not a TikTokenizer vocabulary (a JSON list of rank/token_bytes/token_str "
                            f"objects): {error}") from None
        if not ordered or len(ranks) != len(entries):
            raise DataError(f"{self.path}: ranks must be 0, 1, 2, ... in order, each token's bytes once")
        if any(ranks.get(bytes([i])) != i for i in range(256)):
            raise DataError(f"{self.path}: ranks 0-255 must be the 256 single bytes, in order")
        return ranks

    @classmethod
    def from_options(cls, options: TokenizerOptions) -> TikTokenizer:
        if options.model is None:
            raise DataError("TikTokenizer needs --tokenizer-model")
        if options.tiktoken_pattern is None:
            raise DataError("TikTokenizer needs --tiktoken-pattern v1 or v2")
        special = options.tiktoken_special_tokens.split() if options.tiktoken_special_tokens else None
        return cls(options.model, options.tiktoken_pattern, options.tiktoken_num_special_tokens, special)

    def _options(self) -> dict:
        return {"pattern": self._pattern, "num_special_tokens": self._num_special,
                "special_tokens": list(self._special)}

    @classmethod
    def from_files(cls, files: dict[str, bytes], vocab_size: int) -> TikTokenizer:
        options = _read_json(_required(files, TIKTOKEN_OPTIONS_FILE, cls.__name__), TIKTOKEN_OPTIONS_FILE)
        return cls(TIKTOKEN_FILE, contents=_required(files, TIKTOKEN_FILE, cls.__name__), **options)

    @classmethod
    def options_for(cls, directory: Path) -> TokenizerOptions:
        options = _read_json((directory / TIKTOKEN_OPTIONS_FILE).read_bytes(), str(directory / TIKTOKEN_OPTIONS_FILE))
        return TokenizerOptions(model=str(directory / TIKTOKEN_FILE), tiktoken_pattern=options["pattern"],
                                tiktoken_num_special_tokens=options["num_special_tokens"],
                                tiktoken_special_tokens=" ".join(options["special_tokens"]))

    # Preprocessor workers get the vocabulary itself (not a path they might not see), and build the tiktoken model.
    def __getstate__(self) -> dict:
        return {"path": str(self.path), "contents": self._contents, **self._options()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._special["</s>"]

    def encode(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._model.decode([int(i) for i in ids])

    def files(self) -> dict[str, bytes]:
        return {TIKTOKEN_FILE: self._contents, TIKTOKEN_OPTIONS_FILE: json.dumps(self._options()).encode()}


TOKENIZERS: dict[str, type[Tokenizer]] = {
    cls.__name__: cls for cls in (SentencePieceTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer, NullTokenizer, GPTSentencePieceTokenizer,
                                  Llama2Tokenizer, TikTokenizer)}
if set(TOKENIZERS) != set(TOKENIZER_TYPES):   # the schema's list of --tokenizer-type values is the one list
    raise RuntimeError(f"tokenizer classes {sorted(TOKENIZERS)} differ from the schema's {sorted(TOKENIZER_TYPES)}")


def _tokenizer_class(tokenizer_type: str) -> type[Tokenizer]:
    if tokenizer_type not in TOKENIZERS:
        raise DataError(f"unknown tokenizer type {tokenizer_type!r} (choose from {', '.join(TOKENIZER_TYPES)})")
    return TOKENIZERS[tokenizer_type]


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int = 0, *,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    tiktoken_pattern: str | None = None, tiktoken_num_special_tokens: int = 1000,
                    tiktoken_special_tokens: str | None = None) -> Tokenizer:
    """The tokenizer named by the data options; ``vocab_size`` (the model's) is used by NullTokenizer only."""
    options = TokenizerOptions(tokenizer_model, vocab_file, merge_file, vocab_size, tiktoken_pattern,
                               tiktoken_num_special_tokens, tiktoken_special_tokens)
    return _tokenizer_class(tokenizer_type).from_options(options)


def configured_tokenizer(data: DataConfig, vocab_size: int) -> Tokenizer:
    """The tokenizer of ``--tokenizer-type`` and its file options."""
    return _tokenizer_class(data.tokenizer_type).from_options(TokenizerOptions.of(data, vocab_size))


def tokenizer_options_for(tokenizer_type: str, directory: Path) -> dict[str, Optional[str]]:
    """The data options (DataConfig fields, ``tokenizer_type`` included) naming the files of a tokenizer of this type
    written into ``directory``."""
    return {"tokenizer_type": tokenizer_type, **_tokenizer_class(tokenizer_type).options_for(directory).data_options()}


def tokenizer_from_files(tokenizer_type: str, files: dict[str, bytes], vocab_size: int) -> Tokenizer:
    """The tokenizer of type ``tokenizer_type`` defined by ``files`` (its :meth:`Tokenizer.files`, e.g. a
    checkpoint's copy), for a model of ``vocab_size`` ids."""
    return _tokenizer_class(tokenizer_type).from_files(files, vocab_size)


def _lines(documents: Iterable[str]) -> Iterator[str]:
    for document in documents:
        for line in document.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(documents: Iterable[str], model_prefix: str | os.PathLike, vocab_size: int,
                        model_type: str = "bpe", character_coverage: float = 0.9995, input_sentence_size: int = 0,
                        num_threads: int = 1, verbose: bool = False) -> Path:
    """Train on the non-blank lines of ``documents``; write ``PREFIX.model`` and ``PREFIX.vocab``; return the model.

    ``input_sentence_size`` > 0 trains on that many lines sampled from the input. The result depends on
    ``num_threads``; with the same input and thread count it is the same model. Both files appear atomically.
    """
    prefix = Path(model_prefix)
    model = io.BytesIO()
    lines = _lines(documents)
    first = next(lines, None)
    if first is None:
        raise DataError("no text to train the tokenizer on (every input document is empty)")
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=itertools.chain([first], lines), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage, input_sentence_size=input_sentence_size,
            shuffle_input_sentence=input_sentence_size > 0, num_threads=num_threads,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True, user_defined_symbols=["\n"],
            max_sentence_length=1 << 16, minloglevel=0 if verbose else 2)
    except RuntimeError as error:
        raise DataError(f"training the tokenizer failed: {_sentencepiece_message(error)}") from None
    prefix.parent.mkdir(parents=True, exist_ok=True)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    # The .vocab file is for people (piece, score per line), with the newline piece written as \n.
    vocab = "".join(f"{sp.id_to_piece(i).replace(chr(10), chr(92) + 'n')}\t{sp.get_score(i):g}\n"
                    for i in range(sp.get_piece_size()))
    model_path = prefix.with_name(prefix.name + ".model")
    write_atomically(prefix.with_name(prefix.name + ".vocab"), vocab.encode())
    write_atomically(model_path, model.getvalue())
    return model_path

