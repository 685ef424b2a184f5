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
import hashlib
import io
import itertools
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


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int) -> Tokenizer:
    """The tokenizer named by the data options; ``vocab_size`` (the model's) is used by NullTokenizer only."""
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

