"""Tokenizers: text <-> token ids, plus the vocabulary size and end-of-document (EOD) id the data layer needs.

``SentencePieceTokenizer`` wraps a SentencePiece model (Megatron's ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model PATH``); ``NullTokenizer`` reads text that already is space-separated token ids (pre-tokenized or
mock data), with ids below ``vocab_size`` and EOD = ``vocab_size - 1``.

:func:`train_sentencepiece` trains models for which ``decode(encode(x)) == x`` for any text: identity normalization
(no NFKC), whitespace kept as it is (runs of spaces may become one piece, so indentation is cheap), the newline a piece
of its own (training reads lines, so it would never see one otherwise) and byte fallback, so no character is unknown.
"""

from __future__ import annotations

import abc
import base64
import binascii
import hashlib
import io
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from megalite.data.atomic import write_atomically
from megalite.data.errors import DataError

TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")


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

    def files(self) -> dict[str, bytes]:
        """The files that define this tokenizer (file name -> contents): what a checkpoint stores beside the weights
        and an export writes next to them. Empty for a tokenizer defined by its parameters alone."""
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
        return {"tokenizer.model": self._proto}

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


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int,
                    **megatron_options) -> Tokenizer:
    """The tokenizer named by the data options; ``vocab_size`` (the model's) is used by NullTokenizer only;
    ``megatron_options`` (tiktoken_pattern, tiktoken_num_special_tokens, tiktoken_special_tokens) by TikTokenizer."""
    if tokenizer_type in MEGATRON_TOKENIZERS:   # Megatron's names: see the end of this module
        return build_megatron_tokenizer(tokenizer_type, tokenizer_model, **megatron_options)
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise DataError("SentencePieceTokenizer needs --tokenizer-model")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise DataError(f"unknown tokenizer type {tokenizer_type!r} (choose from {', '.join(TOKENIZER_TYPES)})")


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

    # Preprocessor workers get the vocabulary itself (not a path they might not see), and build the tiktoken model.
    def __getstate__(self) -> dict:
        return {"path": str(self.path), "pattern": self._pattern, "num_special_tokens": self._num_special,
                "special_tokens": list(self._special), "contents": self._contents}

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
        return {"tokenizer.json": self._contents}


MEGATRON_TOKENIZERS = {"Llama2Tokenizer": Llama2Tokenizer, "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
                       "TikTokenizer": TikTokenizer}


def build_megatron_tokenizer(tokenizer_type: str, tokenizer_model: str | None, tiktoken_pattern: str | None = None,
                             tiktoken_num_special_tokens: int = 1000,
                             tiktoken_special_tokens: str | Sequence[str] | None = None) -> Tokenizer:
    """One of Megatron's tokenizer names, built from --tokenizer-model (and the --tiktoken-* options)."""
    if tokenizer_model is None:
        raise DataError(f"{tokenizer_type} needs --tokenizer-model")
    if tokenizer_type != "TikTokenizer":
        return MEGATRON_TOKENIZERS[tokenizer_type](tokenizer_model)
    if tiktoken_pattern is None:
        raise DataError("TikTokenizer needs --tiktoken-pattern v1 or v2")
    special = tiktoken_special_tokens.split() if isinstance(tiktoken_special_tokens, str) else tiktoken_special_tokens
    return TikTokenizer(tokenizer_model, tiktoken_pattern, tiktoken_num_special_tokens, special)
