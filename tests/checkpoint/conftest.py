"""Single-process checkpoint helpers: train a tiny model under a 1x1x1 layout, save it, load it back."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil

import pytest
import torch

from megalite import parallel_state
from megalite.training import Trainer

from ..data.conftest import corpus  # noqa: F401  (a tokenizer and dataset for the generate.py test)
from ..helpers import tiny_config

CPU = torch.device("cpu")


@contextlib.contextmanager
def single_layout():
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def with_checkpoint(cfg, **options):
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **options))


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


def train_and_save(cfg, directory, iterations: int) -> list[float]:
    """Run ``iterations`` steps of ``cfg`` (whose train_iters sets the LR schedule), then save; the losses."""
    with single_layout():
        trainer = Trainer(cfg, CPU)
        result = [trainer.train_step()["loss"] for _ in range(iterations)]
        trainer.save_checkpoint(str(directory))
    return result


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


def perturb_and_save(model: torch.nn.Module, directory):
    """Add small noise to every tensor of a freshly built Hugging Face model (HF initializes biases to 0 and norms to
    1, which would hide a mixed-up mapping), save it with save_pretrained, and return it."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(directory)
    return model
