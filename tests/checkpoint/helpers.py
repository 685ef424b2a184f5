"""Single-process checkpoint helpers: train a tiny model under a 1x1x1 layout and save it; perturb an HF model; and
the checks every Hugging Face conversion test makes (logits both ways, greedy generation against transformers')."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megalite import load_pretrained
from megalite.checkpoint import open_checkpoint
from megalite.checkpoint.convert import export_hf, import_hf
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
        trainer = Trainer(cfg, CPU)
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
