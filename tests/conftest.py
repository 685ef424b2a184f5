"""Fixtures shared across test folders (helpers that are plain functions live in tests/helpers.py)."""

from __future__ import annotations

import pytest

from megalite import extensions
from megalite.kernels import self_check

from .data.helpers import Corpus, build_corpus, build_hf_tokenizer
from .helpers import single_layout


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    """A generated corpus, its tokenizer and indexed dataset, built once per session (tests/data/helpers.py)."""
    return build_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE trained with the tokenizers library, as a Hugging Face tokenizer directory that also
    holds GPT-2's vocab.json and merges.txt (tests/data/helpers.py); built once per session."""
    pytest.importorskip("tokenizers")
    return build_hf_tokenizer(tmp_path_factory.mktemp("hf_tokenizer"))


@pytest.fixture
def single_process_layout():
    """The test runs under a 1x1x1 layout (``pytestmark = pytest.mark.usefixtures("single_process_layout")``)."""
    with single_layout():
        yield


@pytest.fixture
def fresh_extension_cache(monkeypatch, tmp_path):
    """Extensions build (or fail to build) afresh, into a directory of the test's own."""
    monkeypatch.setenv(extensions.DIR_ENV, str(tmp_path / "extensions"))
    monkeypatch.delenv(extensions.DISABLE_ENV, raising=False)
    monkeypatch.setattr(extensions, "_modules", {})
    monkeypatch.setattr(extensions, "_failures", {})
    monkeypatch.setattr(self_check, "_verdicts", {})   # and the kernels check themselves afresh
