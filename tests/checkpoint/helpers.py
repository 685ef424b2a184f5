"""Single-process checkpoint helpers: train a tiny model under a 1x1x1 layout and save it; perturb an HF model; edit
a checkpoint's index or manifest as if it had been saved that way; flip stored bytes."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import torch

from megalite.checkpoint.digests import digest_bytes
from megalite.checkpoint.manifest import MANIFEST_NAME, Manifest

from megalite.training import Trainer

from ..helpers import single_layout

CPU = torch.device("cpu")


def train_and_save(cfg, directory, iterations: int) -> list[float]:
    """Run ``iterations`` steps of ``cfg`` (whose train_iters sets the LR schedule), then save; the losses."""
    with single_layout():
        trainer = Trainer(cfg, CPU)
        result = [trainer.train_step()["loss"] for _ in range(iterations)]
        trainer.save_checkpoint(str(directory))
    return result


def perturb_and_save(model: torch.nn.Module, directory):
    """Add small noise to every tensor of a freshly built Hugging Face model (HF initializes biases to 0 and norms to
    1, which would hide a mixed-up mapping), save it with save_pretrained, and return it."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(directory)
    return model


def rewrite_index(directory: Path, metadata) -> None:
    """Store ``metadata`` as the checkpoint's DCP index, with its digest recorded: a checkpoint saved that way."""
    data = pickle.dumps(metadata)
    (directory / ".metadata").write_bytes(data)
    manifest = Manifest.read(directory)
    digests = dataclasses.replace(manifest.digests, index=digest_bytes(data, manifest.digests.algorithm))
    write_manifest(directory, dataclasses.replace(manifest, digests=digests))


def write_manifest(directory: Path, manifest: Manifest) -> None:
    (directory / MANIFEST_NAME).write_text(manifest.to_json())


def without_digests(directory: Path) -> None:
    """Make ``directory`` a checkpoint as megalite saved them before it recorded digests."""
    write_manifest(directory, dataclasses.replace(Manifest.read(directory), digests=None))


def flip_bytes(path: Path, offset: int, count: int = 1) -> None:
    """Invert ``count`` bytes of ``path`` from ``offset`` (the file keeps its length)."""
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = bytes(b ^ 0xFF for b in data[offset:offset + count])
    path.write_bytes(bytes(data))
