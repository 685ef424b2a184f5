"""Hugging Face gpt-oss (GptOssForCausalLM, built tiny from a config, every tensor perturbed so that sinks, biases
and router biases matter, the clamp small enough to bite): import and export give transformers' logits (1e-5
relative to the largest) and its greedy generation; what megalite would compute differently is refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megalite.checkpoint import CheckpointError
from megalite.checkpoint.convert import HF_CONFIG, import_hf
from megalite.checkpoint.hf_gpt_oss import check_exportable, model_config_from

from .helpers import assert_export_matches, assert_greedy_matches, assert_import_matches, perturb_and_save

transformers = pytest.importorskip("transformers")

VOCAB = 301
LIMIT = 0.3   # gpt-oss' 7 would never clamp a tiny model's activations


def _config(**overrides):
    options = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "num_local_experts": 4,
               "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 64, "swiglu_limit": LIMIT,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}}
    return transformers.GptOssConfig(**{**options, **overrides})


def test_import_export_logits_and_generation_equal_transformers(tmp_path):
    torch.manual_seed(11)
    hf = transformers.GptOssForCausalLM(_config()).eval()
    with torch.no_grad():   # larger sinks and router biases than the perturbation's, so that each changes the output
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
            layer.mlp.router.bias.normal_(0, 1.0)
    hf = perturb_and_save(hf, tmp_path / "hf")
    model = assert_import_matches(hf, tmp_path / "hf", tmp_path / "ckpt", "gpt-oss")
    imported = model.config.model
    assert (imported.quick_geglu, imported.glu_linear_offset, imported.activation_func_clamp_value) == \
        (True, 1.0, LIMIT)
    assert (imported.softmax_type, imported.disable_bias_linear, imported.kv_channels) == ("learnable", False, 24)
    assert (imported.window_size, imported.window_attn_skip_freq) == ("7,0", "[1,0]")
    assert imported.yarn_unrounded_correction_range and imported.rope_scaling_type == "yarn"
    gate_up = hf.model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.abs().max() > LIMIT   # the clamp is exercised (weights of ~0.1 on inputs of norm ~1)
    assert_export_matches(tmp_path / "ckpt", tmp_path / "out", "gpt-oss")
    written = json.loads((tmp_path / "out" / HF_CONFIG).read_text())
    assert written["layer_types"] == ["sliding_attention", "full_attention"] and written["sliding_window"] == 8
    assert written["rope_parameters"]["truncate"] is False
    assert_greedy_matches(model, hf, [5, 17, 300, 2], 20)   # 24 tokens: the window slides past the prompt


def test_options_map_and_refusals():
    default = model_config_from(transformers.GptOssConfig().to_dict())   # gpt-oss-120b's config
    assert (default.num_experts, default.moe_router_topk, default.activation_func_clamp_value) == (128, 4, 7.0)
    assert (default.rotary_base, default.rope_scaling_factor, default.window_size) == (150000, 32.0, "127,0")
    for overrides, message in [({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5 is not supported"),
                               ({"attention_bias": False}, "attention_bias false is not supported"),
                               ({"quantization_config": {"quant_method": "mxfp4"}}, r"quantization_config \(mxfp4\)")]:
        with pytest.raises(CheckpointError, match=message):
            model_config_from({**_config().to_dict(), **overrides})
    for change, message in [({"swiglu": True, "quick_geglu": False}, "quick_geglu=False"),
                            ({"moe_layer_freq": "[1,0]"}, "moe_layer_freq='\\[1,0\\]' has no"),
                            ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True has no GptOss")]:
        with pytest.raises(CheckpointError, match=message):
            check_exportable(dataclasses.replace(model_config_from(_config().to_dict()), **change))


def test_import_refuses_a_quantized_directory_in_one_line(tmp_path):
    _config(quantization_config={"quant_method": "mxfp4"}).save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="dequantize the experts first"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
