"""A small generated corpus, its tokenizer and its indexed dataset (the ``corpus`` fixture of tests/conftest.py)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megalite.data.documents import iter_documents
from megalite.data.indexed_dataset import IndexedDatasetWriter
from megalite.data.preprocess import preprocess
from megalite.data.tokenizer import SentencePieceTokenizer, train_sentencepiece

VOCAB_SIZE = 601  # odd, as the model tests like it
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "ph", "str", "ing", "er", "_", "0", "7")
_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches; "
          "def return class import yield lambda 42 3.14 x_1 = (a, b) -> {k: v} é ü ß 漢字 — ok!").split()


def generated_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of 1-6 lines, with indentation, tabs, odd spacing and non-ASCII text, as a tokenizer meets them."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        lines = []
        for _ in range(rng.randint(1, 6)):
            indent = rng.choice(["", "    ", "        ", "\t", "  "])
            words = [rng.choice(_WORDS) if rng.random() < 0.6 else
                     "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
                     for _ in range(rng.randint(1, 12))]
            lines.append(indent + rng.choice([" ", "  "]).join(words) + rng.choice(["", " ", ""]))
        documents.append("\n".join(lines))
    return documents


@dataclass
class Corpus:
    directory: Path
    documents: list[str]        # the non-blank documents, in file order
    jsonl: Path
    tokenizer_model: Path
    prefix: Path                # of the preprocessed .bin/.idx (with EOD)

    @property
    def tokenizer(self) -> SentencePieceTokenizer:
        return SentencePieceTokenizer(self.tokenizer_model)


def write_jsonl(path: Path, documents: list[str], blanks: bool = True) -> None:
    """One record per document; with ``blanks``, also empty lines and empty documents that must be skipped."""
    with open(path, "w", encoding="utf-8") as handle:
        for i, text in enumerate(documents):
            if blanks and i % 40 == 0:
                handle.write("\n")
                handle.write(json.dumps({"text": ""}) + "\n")
                handle.write(json.dumps({"text": "  \n "}) + "\n")
            handle.write(json.dumps({"text": text, "id": i}) + "\n")


def build_corpus(directory: Path) -> Corpus:
    """400 generated documents as JSON lines in ``directory``, a SentencePiece tokenizer trained on them and their
    preprocessed .bin/.idx."""
    documents = generated_documents(400)
    jsonl = directory / "docs.jsonl"
    write_jsonl(jsonl, documents)
    model = train_sentencepiece(iter_documents([str(jsonl)]), directory / "tokenizer", VOCAB_SIZE)
    prefix = directory / "docs"
    preprocess(iter_documents([str(jsonl)]), SentencePieceTokenizer(model), prefix, workers=1, append_eod=True,
               progress=None)
    return Corpus(directory, documents, jsonl, model, prefix)


def write_progressions(prefix: Path, count: int, vocab_size: int, seed: int = 0) -> None:
    """``count`` documents of 3-30 tokens below ``vocab_size - 1``, each an arithmetic progression (learnable) ended
    by EOD = ``vocab_size - 1`` (NullTokenizer's), as a .bin/.idx: packed samples hold several documents each."""
    rng = random.Random(seed)
    eod = vocab_size - 1
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(count):
            start, stride, length = rng.randrange(eod), rng.randint(1, 7), rng.randint(3, 30)
            writer.add_document([(start + stride * i) % eod for i in range(length)] + [eod])
# Text a tokenizer must split as Hugging Face's does: several scripts, whitespace runs, digits, emoji (with a
# modifier), an end-of-text marker written out, and a final newline run.
MULTILINGUAL = ("Grüße aus Köln, naïve café — ¿qué tal? Привет, мир! 你好，世界。 こんにちは 안녕하세요 مرحبا שלום\n"
                "    def f(x):\t\treturn x**2  # indented\n\n\n   spaces   and\ttabs \t \n1234567890 3.14159 "
                "+1-555-0100 1e-9 🦊🚀👍🏽 🇫🇷 <|endoftext|> trailing   \n\n")
HF_VOCAB_SIZE = 397   # odd
HF_EOD = "<|endoftext|>"


def build_hf_tokenizer(directory: Path) -> Path:
    """A byte-level BPE (GPT-2's kind) trained with the tokenizers library on generated documents, written as a
    Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) and as GPT-2's vocab.json + merges.txt; the
    directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=HF_VOCAB_SIZE, special_tokens=[HF_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(generated_documents(200, seed=1) + [MULTILINGUAL[:80]], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer.model.save(str(directory))   # vocab.json, merges.txt
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": HF_EOD, "eos_token": HF_EOD,
              "unk_token": HF_EOD}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


# ChatML, as many open models' tokenizer_config.json holds it (a system turn first when given).
CHATML_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_chat_tokenizer(directory: Path) -> Path:
    """build_hf_tokenizer's BPE with ChatML's two special tokens added and its template in tokenizer_config.json."""
    from tokenizers import Tokenizer

    build_hf_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML_TEMPLATE}))
    return directory


def chat_records(count: int, seed: int = 0) -> list[dict]:
    """Short conversations of generated text (at most 26 characters of content, so each fits 64 tokens of the chat
    tokenizer): a user/assistant exchange, every fourth after a system turn, every seventh with a second exchange;
    every fifth a prompt/response pair instead."""
    rng = random.Random(seed)
    words = " ".join(generated_documents(50, seed=seed)).split()
    records = []
    while len(records) < count:
        i = len(records)

        def text() -> str:
            return " ".join(rng.choice(words) for _ in range(rng.randint(1, 2)))
        if i % 5 == 4:
            record = {"prompt": text(), "response": text()}
        else:
            messages = [{"role": "system", "content": text()}] if i % 4 == 1 else []
            for _ in range(2 if i % 7 == 3 else 1):
                messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
            record = {"messages": messages}
        contents = [record.get("prompt", ""), record.get("response", "")] + [
            m["content"] for m in record.get("messages", [])]
        if sum(len(c) for c in contents) <= 26:
            records.append(record)
    return records
