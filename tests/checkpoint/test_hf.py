"""Hugging Face GPT-2 conversion: logits agree both ways (odd vocabulary 301, tied and untied output layer).

A random GPT2LMHeadModel (local GPT2Config, nothing downloaded) imported into megalite gives the same logits; a
megalite model trained a few steps, exported, gives the same logits in transformers. Tolerance 1e-5 relative to the
largest logit (measured: 0, the two run the same float operations on the CPU).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megalite import load_pretrained
from megalite.checkpoint import CheckpointError, open_checkpoint
from megalite.checkpoint.convert import export_hf, import_hf
from megalite.checkpoint.hf_gpt2 import check_exportable
from megalite.config import ModelConfig

from ..helpers import tiny_config
from .helpers import perturb_and_save, train_and_save

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

RTOL = 1e-5
VOCAB = 301     # not a multiple of 128: megalite pads it, HF must not see the padding


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _random_gpt2(directory, tie: bool, activation: str = "gelu"):
    torch.manual_seed(7)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     activation_function=activation, tie_word_embeddings=tie,
                                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return perturb_and_save(transformers.GPT2LMHeadModel(config).eval(), directory)


@pytest.mark.parametrize("tie", [True, False])
def test_import_gives_the_same_logits(tmp_path, tie):
    hf = _random_gpt2(tmp_path / "hf", tie)
    path = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    manifest = open_checkpoint(path).manifest
    assert manifest.iteration == 0 and not manifest.has_optimizer
    model = load_pretrained(tmp_path / "ckpt")
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = hf(tokens).logits, model(tokens)
    difference = _relative(actual, expected)
    print(f"HF -> megalite (tied={tie}): max rel logit diff {difference:.1e}")
    assert actual.shape == (2, 32, VOCAB) and difference < RTOL


@pytest.mark.parametrize("tie", [True, False])
def test_export_gives_the_same_logits(tmp_path, tie):
    cfg = tiny_config(model={"untie_embeddings_and_output_weights": not tie}, data={"eval_interval": 0})
    train_and_save(cfg, tmp_path / "ckpt", 3)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == VOCAB
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    model = load_pretrained(tmp_path / "ckpt")
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = model(tokens), hf(tokens).logits
    difference = _relative(actual, expected)
    print(f"megalite -> HF (tied={tie}): max rel logit diff {difference:.1e}")
    assert actual.shape == (2, 32, VOCAB) and difference < RTOL


def test_tanh_gelu_is_refused_unless_allowed(tmp_path):
    _random_gpt2(tmp_path / "hf", tie=True, activation="gelu_new")
    with pytest.raises(CheckpointError, match="'gelu_new' is not supported .*tanh approximation"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    import_hf(tmp_path / "hf", tmp_path / "ckpt", allow_approximate_gelu=True)
    assert open_checkpoint(tmp_path / "ckpt").manifest.iteration == 0


def test_export_refuses_options_gpt2_cannot_express():
    check_exportable(ModelConfig(num_layers=3, untie_embeddings_and_output_weights=True))
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for option, value in [("swiglu", True), ("normalization", "RMSNorm"), ("position_embedding_type", "rope")]:
        if option in names:   # model options another change brings
            with pytest.raises(CheckpointError, match=f"{option}={value!r} has no GPT-2 counterpart"):
                check_exportable(ModelConfig(**{option: value}))
