"""The tokenizer a checkpoint holds: rebuilt from its type and files for generation and ``load_pretrained``, named
by data options for a run that trains on with it, and read from (or written to) a Hugging Face directory.

A checkpoint's manifest names the tokenizer's type, the files of ``Tokenizer.files()`` stored beside it, its
vocabulary size and EOD (manifests of older versions name one ``file``). Rebuilding goes through
``megalite.data.tokenizer.tokenizer_from_files``, so any tokenizer type saved that way comes back without code here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from megalite.checkpoint.contents import Checkpoint, open_checkpoint
from megalite.checkpoint.errors import CheckpointError
from megalite.config import MegaliteConfig
from megalite.config.flags import FLAG
from megalite.data.tokenizer import (HF_TOKENIZER_FILE, GPT2_MERGE_FILE, GPT2_VOCAB_FILE, GPT2BPETokenizer,
                                     HuggingFaceTokenizer, Tokenizer, tokenizer_from_files, tokenizer_options_for)


def _file_names(info: dict) -> list[str]:
    return list(info.get("files") or ([info["file"]] if info.get("file") else []))


def _files_directory(checkpoint: Checkpoint) -> Path:
    """Where save.py's _save_tokenizer writes the tokenizer's files: beside the manifest."""
    return checkpoint.path


def saved_tokenizer(checkpoint: Checkpoint) -> Optional[Tokenizer]:
    """The tokenizer the checkpoint was trained with, or None if it holds none (mock data, an import without one)."""
    info = checkpoint.manifest.tokenizer
    if not info:
        return None
    files, directory = {}, _files_directory(checkpoint)
    for name in _file_names(info):
        if not (directory / name).is_file():
            raise CheckpointError(f"{checkpoint.path}: incomplete checkpoint: its tokenizer file {name} is missing")
        files[name] = (directory / name).read_bytes()
    vocab_size = info.get("vocab_size") or checkpoint.manifest.megalite_config().model.vocab_size
    return tokenizer_from_files(info["type"], files, vocab_size)


def with_checkpoint_tokenizer(cfg: MegaliteConfig) -> MegaliteConfig:
    """``cfg`` training on ``--data-path`` with no tokenizer option and a ``--load`` checkpoint that holds a
    tokenizer: with the tokenizer options naming that tokenizer's files in the checkpoint (an imported Hugging Face
    model trains with its own tokenizer). Otherwise ``cfg`` itself."""
    d, load = cfg.data, cfg.checkpoint.load
    if d.mock_data or d.data_path is None or d.tokenizer_given() or load is None:
        return cfg
    checkpoint = open_checkpoint(load, allow_none=True)
    info = checkpoint.manifest.tokenizer if checkpoint is not None else None
    if not info:
        where = f"the {FLAG.load} checkpoint {checkpoint.path}" if checkpoint is not None else f"{FLAG.load} {load}"
        raise CheckpointError(f"{FLAG.data_path} needs {FLAG.tokenizer_type} and its files ({FLAG.tokenizer_model} or "
                              f"{FLAG.vocab_file}/{FLAG.merge_file}): {where} holds no tokenizer")
    data = dataclasses.replace(d, **tokenizer_options_for(info["type"], _files_directory(checkpoint)))
    return dataclasses.replace(cfg, data=data)


def hf_tokenizer(directory: Path) -> Optional[Tokenizer]:
    """The tokenizer of a Hugging Face model directory: ``tokenizer.json`` (HuggingFaceTokenizer), else ``vocab.json``
    and ``merges.txt`` (GPT2BPETokenizer), else None."""
    if (directory / HF_TOKENIZER_FILE).is_file():
        return HuggingFaceTokenizer.from_directory(directory)
    if (directory / GPT2_VOCAB_FILE).is_file() and (directory / GPT2_MERGE_FILE).is_file():
        return GPT2BPETokenizer({name: (directory / name).read_bytes() for name in (GPT2_VOCAB_FILE, GPT2_MERGE_FILE)},
                                str(directory))
    return None
