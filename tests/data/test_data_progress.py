"""The bars data preparation shows on a terminal: tokenizing (against the input's size), checking a dataset's
tokens and building its sample index, each ending at 100%; --quiet shows none."""

from __future__ import annotations

import dataclasses
import io

from megalite import progress
from megalite.data import build_datasets
from megalite.data.documents import iter_documents
from megalite.data.preprocess import preprocess

from .test_gpt_dataset import real_config


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def final_lines(screen: Terminal) -> list[str]:
    """What stays on the screen: each bar's last drawing."""
    return [line.split("\r")[-1].removesuffix("\033[K") for line in screen.getvalue().split("\n") if line]


def test_data_preparation_shows_bars_and_quiet_hides_them(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.delenv("RANK", raising=False)
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    documents = iter_documents([str(corpus.jsonl)])
    preprocess(documents, corpus.tokenizer, tmp_path / "again", progress=screen)
    size = corpus.jsonl.stat().st_size
    assert documents.bytes_read == documents.total_bytes == size
    cfg = real_config(corpus, data_cache_path=str(tmp_path / "cache"))
    build_datasets(cfg, (64, 0, 0))
    lines = final_lines(screen)
    assert [line.split(":")[0] for line in lines] == ["tokenizing", "checking the tokens of docs.bin",
                                                      "building the train sample index of docs"]
    assert all(": 100% |" in line for line in lines), lines
    assert f"/{progress.format_count(size)} bytes" in lines[0] and "400 docs" in lines[0]
    quiet = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, quiet=True),
                                data=dataclasses.replace(cfg.data, data_cache_path=str(tmp_path / "cache2")))
    screen.seek(0)
    screen.truncate()
    build_datasets(quiet, (64, 0, 0))
    assert screen.getvalue() == ""
