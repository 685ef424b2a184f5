"""Hugging Face Llama conversion: logits agree both ways (grouped-query attention, odd vocabulary 301, tied and untied
output layer), the tool picks GPT-2 or Llama by itself, and what megalite cannot compute is refused in one line.

A random LlamaForCausalLM (local LlamaConfig, nothing downloaded) imported into megalite gives the same logits; a
Llama-shaped megalite model trained a few steps, exported, gives the same logits in transformers. Tolerance 1e-5
relative to the largest logit, as for GPT-2 (measured: below 1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch

from megalite import load_pretrained
from megalite.checkpoint import CheckpointError, open_checkpoint
from megalite.checkpoint.convert import export_hf, hf_architecture, import_hf
from megalite.checkpoint.hf_llama import check_exportable, model_config_from
from megalite.config import ModelConfig

from ..helpers import tiny_config
from .helpers import perturb_and_save, train_and_save
from .test_tools import _tool

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

RTOL = 1e-5
VOCAB = 301     # not a multiple of 128: megalite pads it, HF must not see the padding
LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
         "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 176, "rotary_base": 500000}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))


def _llama_config(tie: bool = False, **overrides):
    options = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
               "rope_theta": 500000.0, "tie_word_embeddings": tie, "bos_token_id": VOCAB - 1,
               "eos_token_id": VOCAB - 1}
    return transformers.LlamaConfig(**{**options, **overrides})


def _random_llama(directory, tie: bool):
    torch.manual_seed(7)
    return perturb_and_save(transformers.LlamaForCausalLM(_llama_config(tie)).eval(), directory)


@pytest.mark.parametrize("tie", [True, False])
def test_import_gives_the_same_logits(tmp_path, tie):
    hf = _random_llama(tmp_path / "hf", tie)
    path = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    manifest = open_checkpoint(path).manifest
    assert manifest.iteration == 0 and not manifest.has_optimizer
    model = load_pretrained(tmp_path / "ckpt")
    imported = model.config.model
    assert (imported.query_groups, imported.rotary_base, imported.untie_embeddings_and_output_weights) == \
        (2, 500000, not tie)
    tokens = _tokens(0)
    with torch.no_grad():
        expected, actual = hf(tokens).logits, model(tokens)
    difference = _relative(actual, expected)
    print(f"HF Llama -> megalite (tied={tie}): max rel logit diff {difference:.1e}, "
          f"abs {float((actual - expected).abs().max()):.1e}")
    assert actual.shape == (2, 32, VOCAB) and difference < RTOL


@pytest.mark.parametrize("tie", [True, False])
def test_export_gives_the_same_logits(tmp_path, tie):
    cfg = tiny_config(model={**LLAMA, "untie_embeddings_and_output_weights": not tie}, data={"eval_interval": 0})
    train_and_save(cfg, tmp_path / "ckpt", 3)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (VOCAB, 2, tie)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    model = load_pretrained(tmp_path / "ckpt")
    tokens = _tokens(1)
    with torch.no_grad():
        expected, actual = model(tokens), hf(tokens).logits
    difference = _relative(actual, expected)
    print(f"megalite -> HF Llama (tied={tie}): max rel logit diff {difference:.1e}, "
          f"abs {float((actual - expected).abs().max()):.1e}")
    assert actual.shape == (2, 32, VOCAB) and difference < RTOL


def test_head_dim_imports_as_kv_channels_with_the_same_logits(tmp_path):
    """A head_dim other than hidden / heads (Qwen3-style) is megalite's --kv-channels, both ways."""
    torch.manual_seed(5)
    hf = perturb_and_save(transformers.LlamaForCausalLM(_llama_config(head_dim=32)).eval(), tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_pretrained(tmp_path / "ckpt")
    assert model.config.model.kv_channels == 32 and model.config.model.head_dim == 32
    tokens = _tokens(2)
    with torch.no_grad():
        difference = _relative(model(tokens), hf(tokens).logits)
    print(f"HF Llama head_dim 32 -> megalite --kv-channels 32: max rel logit diff {difference:.1e}")
    assert difference < RTOL
    export_hf(tmp_path / "ckpt", tmp_path / "hf2")
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["head_dim"] == 32


def test_multi_head_llama_round_trips_without_grouping(tmp_path):
    """num_key_value_heads == heads imports as plain multi-head attention, and exports back the same."""
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(_llama_config(num_key_value_heads=4)).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not open_checkpoint(tmp_path / "ckpt").manifest.megalite_config().model.group_query_attention
    export_hf(tmp_path / "ckpt", tmp_path / "hf2")
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["num_key_value_heads"] == 4


def test_tool_picks_the_architecture_and_round_trips(tmp_path, capsys):
    _random_llama(tmp_path / "hf", tie=False)
    convert = _tool("convert_checkpoint")
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert convert.main(["inspect", "--load", str(tmp_path / "ckpt")]) == 0
    assert "normalization=RMSNorm" in capsys.readouterr().out
    assert convert.main(["export-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
                         "--dtype", "bfloat16"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.bfloat16


@pytest.mark.parametrize("overrides, message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}}, "rope scaling 'llama3' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_tool_refuses_what_megalite_would_compute_differently(tmp_path, capsys, overrides, message):
    _llama_config(**overrides).save_pretrained(tmp_path / "hf")   # refused on reading config.json: no weights needed
    convert = _tool("convert_checkpoint")
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint: error:") and message in err and "\n" not in err
    assert not (tmp_path / "ckpt").exists()


def test_both_config_formats_give_the_rotary_base():
    legacy = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 500000.0,
              "rope_scaling": None}
    current = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
               "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert model_config_from(legacy).rotary_base == model_config_from(current).rotary_base == 500000
    with pytest.raises(CheckpointError, match="rope scaling 'linear'"):
        model_config_from({**legacy, "rope_scaling": {"type": "linear", "factor": 2.0}})


def test_export_picks_gpt2_or_llama_and_refuses_half_llamas():
    assert hf_architecture(ModelConfig()).ARCHITECTURE == "GPT2LMHeadModel"
    assert hf_architecture(tiny_config(model=LLAMA).model).ARCHITECTURE == "LlamaForCausalLM"
    check_exportable(tiny_config(model=LLAMA).model)
    for option, value in [("position_embedding_type", "learned_absolute"), ("normalization", "LayerNorm"),
                          ("swiglu", False), ("disable_bias_linear", False)]:
        half = tiny_config(model={**LLAMA, option: value}).model
        assert hf_architecture(half).ARCHITECTURE == "LlamaForCausalLM"
        with pytest.raises(CheckpointError, match=f"{option}={value!r} .*exports as GPT2LMHeadModel"):
            check_exportable(half)
