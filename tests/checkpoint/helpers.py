"""Single-process checkpoint helpers: train a tiny model under a 1x1x1 layout and save it; perturb an HF model; edit a
checkpoint's index or manifest as if it had been saved that way; damage stored bytes (each damage returns the end of
the line that must report it); the one line of a refused pretrain_gpt.py run; and the checks every Hugging Face
conversion test makes (logits both ways, greedy generation against transformers')."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Optional

import torch

import pretrain_gpt
from megalite import load_pretrained
from megalite.checkpoint import open_checkpoint
from megalite.checkpoint.convert import export_hf, import_hf
from megalite.checkpoint.digests import digest_bytes
from megalite.checkpoint.manifest import MANIFEST_NAME, Manifest
from megalite.training import Trainer

from ..helpers import single_layout

CPU = torch.device("cpu")
# Tolerance of logits against transformers, relative to the largest logit (measured: below 1e-6; the two run the
# same float operations on the CPU, in a few places in another order).
RTOL = 1e-5
VOCAB = 301     # not a multiple of 128: megalite pads it, HF must not see the padding


def train_and_save(cfg, directory, iterations: int) -> list[float]:
    """Run ``iterations`` steps of ``cfg`` (whose train_iters sets the LR schedule), then save; the losses."""
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, CPU)
        result = [trainer.train_step()["loss"] for _ in range(iterations)]
        trainer.save_checkpoint(str(directory))
    return result


def perturb_and_save(model: torch.nn.Module, directory):
    """Add small noise to every tensor of a freshly built Hugging Face model (HF initializes biases to 0 and norms to
    1, which would hide a mixed-up mapping), save it with save_pretrained, and return it."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
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
def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def random_tokens(seed: int, vocab: int = VOCAB, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))


def assert_import_matches(hf, hf_dir: Path, ckpt_dir: Path, label: str):
    """Import ``hf_dir`` (holding ``hf``): a checkpoint at iteration 0 without optimizer state whose logits equal
    the HF model's within RTOL; the loaded megalite model."""
    manifest = open_checkpoint(import_hf(hf_dir, ckpt_dir)).manifest
    assert manifest.iteration == 0 and not manifest.has_optimizer
    model = load_pretrained(ckpt_dir)
    tokens = random_tokens(0, model.vocab_size)
    with torch.no_grad():
        expected, actual = hf(tokens).logits, model(tokens)
    difference = relative(actual, expected)
    print(f"HF -> megalite ({label}): max rel logit diff {difference:.1e}")
    assert actual.shape == expected.shape and difference < RTOL
    return model


def assert_export_matches(ckpt_dir: Path, hf_dir: Path, label: str, architecture: Optional[str] = None):
    """Export ``ckpt_dir``: transformers loads it with the checkpoint's logits within RTOL; the HF model."""
    import transformers

    export_hf(ckpt_dir, hf_dir, architecture=architecture)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    model = load_pretrained(ckpt_dir)
    tokens = random_tokens(1, model.vocab_size)
    with torch.no_grad():
        expected, actual = model(tokens), hf(tokens).logits
    difference = relative(actual, expected)
    print(f"megalite -> HF ({label}, {type(hf).__name__}): max rel logit diff {difference:.1e}")
    assert actual.shape == expected.shape and difference < RTOL
    return hf


def assert_greedy_matches(model, hf, prompt: list[int], new_tokens: int) -> None:
    """megalite's greedy continuation of ``prompt``, with the KV cache and without, equals transformers' generate
    (and is not one token repeated, which would hide a cache that forgets the context)."""
    ours = model.generate(prompt, new_tokens)
    stop = {} if model.eod is None else {"eos_token_id": model.eod}   # both stop after it
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **stop)
    assert ours == theirs[0, len(prompt):].tolist() == model.generate(prompt, new_tokens, use_cache=False)
    assert len(set(ours)) > 1, ours
