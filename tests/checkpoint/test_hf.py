"""Hugging Face GPT-2 conversion: logits agree both ways (odd vocabulary 301, tied and untied output layer, the exact
GeLU and OpenAI's tanh one), greedy generation (KV cache or not) equals transformers', and what GPT-2 cannot say is
refused.

A random GPT2LMHeadModel (local GPT2Config, nothing downloaded) imported into megalite gives the same logits; a
megalite model trained a few steps, exported, gives the same logits in transformers. Tolerance RTOL (1e-5) relative
to the largest logit (measured: 0 for the exact GeLU, below 1e-6 for gelu_new, which transformers writes out in
tanh and pow where megalite calls F.gelu(approximate="tanh")).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megalite.checkpoint import CheckpointError, open_checkpoint
from megalite.checkpoint.convert import export_hf, import_hf
from megalite.checkpoint.hf_gpt2 import check_exportable
from megalite.checkpoint.load import load_weights
from megalite.config import ModelConfig
from megalite.model import GPTModel

from ..helpers import single_layout, tiny_config
from .helpers import (RTOL, VOCAB, assert_export_matches, assert_greedy_matches, assert_import_matches,
                      perturb_and_save, random_tokens, relative,
                      train_and_save)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _random_gpt2(directory, tie: bool, activation: str = "gelu"):
    torch.manual_seed(7)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     activation_function=activation, tie_word_embeddings=tie,
                                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return perturb_and_save(transformers.GPT2LMHeadModel(config).eval(), directory)


@pytest.mark.parametrize("activation, tie", [("gelu", True), ("gelu", False), ("gelu_new", True),
                                             ("gelu_pytorch_tanh", False)])
def test_import_gives_the_same_logits_and_generation(tmp_path, activation, tie):
    hf = _random_gpt2(tmp_path / "hf", tie, activation)
    model = assert_import_matches(hf, tmp_path / "hf", tmp_path / "ckpt", f"{activation}, tied={tie}")
    assert model.config.model.openai_gelu == (activation != "gelu")
    assert_greedy_matches(model, hf, [5, 17, 300, 2], 24)


@pytest.mark.parametrize("tie, openai_gelu", [(True, False), (False, True)])
def test_export_gives_the_same_logits(tmp_path, tie, openai_gelu):
    cfg = tiny_config(model={"untie_embeddings_and_output_weights": not tie, "openai_gelu": openai_gelu},
                      data={"eval_interval": 0})
    train_and_save(cfg, tmp_path / "ckpt", 3)
    hf = assert_export_matches(tmp_path / "ckpt", tmp_path / "hf", f"tied={tie}, openai_gelu={openai_gelu}")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert type(hf).__name__ == "GPT2LMHeadModel" and config["vocab_size"] == VOCAB
    assert config["activation_function"] == ("gelu_new" if openai_gelu else "gelu")


def test_other_activations_are_refused_by_name(tmp_path):
    _random_gpt2(tmp_path / "hf", tie=True, activation="relu")
    with pytest.raises(CheckpointError, match="activation_function 'relu' is not supported .*exact .*tanh"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_export_refuses_options_gpt2_cannot_express():
    check_exportable(ModelConfig(num_layers=3, untie_embeddings_and_output_weights=True, openai_gelu=True))
    # How it trained or computed its numbers is no part of the exported model.
    check_exportable(ModelConfig(seq_length=16, hidden_dropout=0.0, init_method_std=0.01, fp8_format="e4m3",
                                 fp8_recipe="rowwise", fp8_param_gather=True, recompute_granularity="full",
                                 make_vocab_size_divisible_by=64))
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for option, value in [("swiglu", True), ("normalization", "RMSNorm"), ("position_embedding_type", "rope"),
                          ("use_rope_scaling", True), ("add_qkv_bias", True)]:
        if option in names:   # model options another change brings
            with pytest.raises(CheckpointError, match=f"{option}={value!r} has no GPT-2 counterpart"):
                check_exportable(ModelConfig(**{option: value}))


def test_an_fp8_trained_checkpoint_exports(tmp_path):
    """FP8 is how a model trains (its bf16 weights' products rounded to FP8), not what the weights compute: the export
    holds the trained weights, and transformers gives the logits megalite computes from them without FP8."""
    cfg = tiny_config(model={"fp8_format": "hybrid", "fp8_recipe": "tensorwise"}, data={"eval_interval": 0},
                      training={"bf16": True, "micro_batch_size": 4, "global_batch_size": 4})
    train_and_save(cfg, tmp_path / "ckpt", 2)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with single_layout(), torch.no_grad():
        gpt = GPTModel(dataclasses.replace(cfg.model, fp8_format=None)).eval()
        load_weights(open_checkpoint(tmp_path / "ckpt"), list(gpt.canonical_named_parameters()))
        tokens = random_tokens(1)
        difference = relative(hf(tokens).logits, gpt.full_logits(tokens))
    print(f"FP8-trained megalite -> HF GPT-2: max rel logit diff {difference:.1e}")
    assert difference < RTOL
