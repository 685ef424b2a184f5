"""Gemma 3 (text) <-> megalite: a random Gemma3ForCausalLM (built from a local config, nothing downloaded; every
tensor perturbed, so norm weights, which start at 0 in the 1 + w form, matter) imports with the same logits and greedy
generation; a trained megalite Gemma exports to one transformers loads with the same logits; what megalite would
compute differently is refused by name."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from megalite.checkpoint import CheckpointError
from megalite.checkpoint.convert import hf_architecture
from megalite.checkpoint.hf_gemma3 import check_exportable, model_config_from

from ..helpers import tiny_config
from .helpers import VOCAB, assert_export_matches, assert_greedy_matches, assert_import_matches, perturb_and_save, \
    train_and_save
from .test_tools import _tool

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# A sliding layer (a window of 8: the query and 7 before it) with its own rope base, then a global layer with a
# linearly scaled one, as Gemma 3's big models; head_dim 32 of 4 heads over hidden 64, query_pre_attn_scalar
# not the head dimension.
LAYER_TYPES = ["sliding_attention", "full_attention"]
GEMMA3 = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 24, "sliding_window": 8, "layer_types": LAYER_TYPES,
          "rope_theta": 100000.0, "rope_local_base_freq": 1000.0,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0},
          "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
# The same model built by megalite's options.
OPTIONS = {"num_layers": 2, "ffn_hidden_size": 176, "group_query_attention": True, "num_query_groups": 2,
           "kv_channels": 32, "position_embedding_type": "rope", "normalization": "RMSNorm", "apply_layernorm_1p": True,
           "qk_layernorm": True, "sandwich_norm": True, "scale_embeddings": True, "gated_linear_unit": True,
           "openai_gelu": True, "disable_bias_linear": True, "softmax_scale": 24 ** -0.5, "window_size": "7,0",
           "window_attn_skip_freq": "2", "rotary_base": 100000, "local_rotary_base": 1000,
           "use_rope_scaling": True, "rope_scaling_type": "linear", "rope_scaling_factor": 2.0,
           "layernorm_epsilon": 1e-6}


def _random_model(directory, **overrides):
    torch.manual_seed(3)   # a model whose greedy continuation below is not one token repeated
    config = transformers.Gemma3TextConfig(**{**GEMMA3, **overrides})
    return perturb_and_save(transformers.Gemma3ForCausalLM(config).eval(), directory)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False, "hidden_activation": "gelu",
                                            "layer_types": None, "sliding_window_pattern": 2, "rope_scaling": None,
                                            "sliding_window": 64}],
                         ids=["gemma3", "untied-exact-gelu-window-covers-context"])
def test_import_gives_the_same_logits_and_generation(tmp_path, overrides):
    """Generation (with and without the KV cache) is checked for the first: its window slides past the prompt."""
    hf = _random_model(tmp_path / "hf", **overrides)
    model = assert_import_matches(hf, tmp_path / "hf", tmp_path / "ckpt", f"gemma3 {overrides}")
    imported = model.config.model
    expected = {**OPTIONS, "untie_embeddings_and_output_weights": "tie_word_embeddings" in overrides}
    if overrides:   # every second layer global (pattern 2), its window kept: the layers' rope bases differ
        expected.update(openai_gelu=False, window_size="63,0", use_rope_scaling=False, rope_scaling_type="llama3",
                        rope_scaling_factor=8.0)
    assert {k: getattr(imported, k) for k in expected} == expected
    if not overrides:
        assert_greedy_matches(model, hf, [11, 250, 3, 77, 140, 9], 12)   # 18 tokens, over twice the window


def test_export_gives_the_same_logits(tmp_path):
    cfg = tiny_config(model=OPTIONS, data={"eval_interval": 0})
    train_and_save(cfg, tmp_path / "ckpt", 3)
    hf = assert_export_matches(tmp_path / "ckpt", tmp_path / "hf", "gemma3")
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["query_pre_attn_scalar"], config["sliding_window"], config["layer_types"]) == (24, 8, LAYER_TYPES)
    reimported = model_config_from(config)
    assert {k: getattr(reimported, k) for k in OPTIONS} == OPTIONS


@pytest.mark.parametrize("overrides, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope scaling 'linear' of the sliding_attention layers is not supported"),
], ids=["attention-softcapping", "final-softcapping", "bidirectional", "silu", "scaled-sliding-rope"])
def test_tool_refuses_what_megalite_would_compute_differently(tmp_path, capsys, overrides, message):
    config = {**GEMMA3, **overrides}
    if "rope_parameters" in overrides:
        config.pop("rope_scaling")
    transformers.Gemma3TextConfig(**config).save_pretrained(tmp_path / "hf")   # refused on reading config.json
    convert = _tool("convert_checkpoint")
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint: error:") and message in err and "\n" not in err, err
    assert not (tmp_path / "ckpt").exists()


def test_export_refuses_half_gemmas():
    model = tiny_config(model=OPTIONS).model
    assert hf_architecture(model) == hf_architecture(dataclasses.replace(model, sandwich_norm=False)) == \
        "Gemma3ForCausalLM"
    llama = {"gated_linear_unit": False, "swiglu": True, "sandwich_norm": False, "scale_embeddings": False,
             "local_rotary_base": None, "window_size": None, "window_attn_skip_freq": None}
    assert hf_architecture(dataclasses.replace(model, **llama)) == "Qwen3ForCausalLM"   # refused there by name
    check_exportable(model)
    for change, message in [({"sandwich_norm": False}, "model option sandwich_norm=False (a Gemma 3 needs"),
                            ({"local_rotary_base": None}, "its sliding layers' rope would be scaled too"),
                            ({"softmax_scale": 0.3}, "softmax_scale 0.3 is not query_pre_attn_scalar^-0.5"),
                            ({"rotary_percent": 0.5}, "model option rotary_percent=0.5 has no Gemma 3 counterpart")]:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            check_exportable(dataclasses.replace(model, **change))
