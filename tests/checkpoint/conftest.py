"""Checkpoint fixtures: the tiny configuration, and a checkpoint of 3 training steps made once per session."""

from __future__ import annotations

import shutil

import pytest

from ..helpers import tiny_config
from .helpers import train_and_save


@pytest.fixture
def cfg():
    return tiny_config(data={"eval_interval": 0})


@pytest.fixture(scope="session")
def _pristine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pristine") / "ckpt"
    train_and_save(tiny_config(data={"eval_interval": 0}), directory, 3)
    return directory


@pytest.fixture
def saved(_pristine, tmp_path):
    """A save directory holding a checkpoint of 3 steps of the tiny model (Adam states, RNG): a fresh copy of one
    made once per session, so a test may damage it."""
    shutil.copytree(_pristine, tmp_path / "ckpt")
    return tmp_path / "ckpt"
