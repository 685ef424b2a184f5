"""Fixtures shared across test folders (helpers that are plain functions live in tests/helpers.py)."""

from __future__ import annotations

import pytest

from megalite import extensions

from .data.helpers import Corpus, build_corpus
from .helpers import single_layout


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    """A generated corpus, its tokenizer and indexed dataset, built once per session (tests/data/helpers.py)."""
    return build_corpus(tmp_path_factory.mktemp("corpus"))


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
