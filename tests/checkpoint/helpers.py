"""Single-process checkpoint helpers: train a tiny model under a 1x1x1 layout and save it; perturb an HF model; edit a
checkpoint's index or manifest as if it had been saved that way; damage stored bytes (each damage returns the end of
the line that must report it); the one line of a refused pretrain_gpt.py run."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import torch

import pretrain_gpt
from megalite.checkpoint import open_checkpoint
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


def refused(argv: list[str], capsys) -> str:
    """The one line pretrain_gpt.py prints for ``argv``, which must exit with code 2 (without its prefix)."""
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megalite: error: ") and "\n" not in err, err
    return err.removeprefix("megalite: error: ")


def item_at(checkpoint, relative_path: str, offset: int) -> str:
    """The key of the item whose stored bytes hold ``offset`` of the data file."""
    return next(index.fqn for index, info in checkpoint.metadata.storage_data.items()
                if info.relative_path == relative_path and info.offset <= offset < info.offset + info.length)


def flip_payload(directory: Path) -> str:
    """2,000 bytes in the middle of rank 0's data file, its header intact (an Adam moment there would turn NaN)."""
    data = directory / "__0_0.distcp"
    start = data.stat().st_size // 2 - 1000
    item = item_at(open_checkpoint(directory), data.name, start)   # the first one damaged
    flip_bytes(data, start, 2000)
    return f"__0_0.distcp: checksum mismatch in {item}"


def flip_index(directory: Path) -> str:
    path = directory / ".metadata"
    flip_bytes(path, path.stat().st_size // 2)
    return ".metadata: checksum mismatch (DCP's index changed since it was saved)"


def flip_manifest_value(directory: Path) -> str:
    """One bit of the consumed samples (the JSON stays valid)."""
    path, samples = directory / MANIFEST_NAME, Manifest.read(directory).consumed_samples
    path.write_text(path.read_text().replace(f'"consumed_samples": {samples}', f'"consumed_samples": {samples ^ 1}'))
    return "manifest.json: checksum mismatch (the manifest changed since it was saved)"


def flip_manifest_key(directory: Path) -> str:
    """One bit of a key's name (a key not read would otherwise be ignored)."""
    path = directory / MANIFEST_NAME
    path.write_text(path.read_text().replace('"manifest_digest"', '"manifest_digesu"', 1))
    return "manifest.json: malformed manifest (unknown key 'manifest_digesu')"
