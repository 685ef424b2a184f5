"""Hugging Face DeepSeek-V3 (multi-latent attention with and without the query's low-rank projection, interleaved
rotary channels, yarn with mscale_all_dim, group-limited sigmoid routing with the score-correction bias, a routed
scaling factor, shared experts, a dense first layer) imports and exports with the same logits (tiny random models,
odd vocabulary 301; tolerance 1e-5 relative to the largest logit) and the same greedy generation through the latent
KV cache; a multi-token-prediction layer is refused in one line."""

from __future__ import annotations

import pytest
import torch

from megalite.checkpoint import CheckpointError
from megalite.checkpoint.convert import HF_WEIGHTS, import_hf

from .helpers import assert_export_matches, assert_greedy_matches, assert_import_matches

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.8}


def _hf_model(directory, **overrides):
    options = dict(vocab_size=301, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                   num_attention_heads=4, n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=2.5,
                   kv_lora_rank=24, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4,
                   topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=64,
                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, rope_parameters=YARN)
    torch.manual_seed(5)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**options, **overrides})).eval()
    with torch.no_grad():   # parameters and the router's score-correction bias (a buffer) away from 0 and 1
        for name, tensor in hf.state_dict().items():
            tensor.add_(torch.randn_like(tensor) * (0.3 if "e_score_correction_bias" in name else 0.1))
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "rope_parameters": {"rope_theta": 5000.0},
                                            "rope_interleave": False, "tie_word_embeddings": True}],
                         ids=["deepseek-v3", "v2-lite-style"])
def test_import_export_and_generation_match_transformers(tmp_path, overrides):
    """Without q_lora_rank (DeepSeek-V2-Lite's plain query projection), plain rope, rotate-half channels, tied."""
    hf = _hf_model(tmp_path / "hf", **overrides)
    model = assert_import_matches(hf, tmp_path / "hf", tmp_path / "ckpt", f"deepseek_v3 {overrides}")
    imported = model.config.model
    assert imported.multi_latent_attention and imported.q_lora_rank == overrides.get("q_lora_rank", 32)
    assert (imported.moe_router_num_groups, imported.moe_router_group_topk, imported.moe_layers()) == (
        4, 2, [False, True, True])
    assert_greedy_matches(model, hf, [5, 17, 300, 2], 12)
    assert_export_matches(tmp_path / "ckpt", tmp_path / "out", f"deepseek_v3 {overrides}")


def test_multi_token_prediction_layers_are_refused(tmp_path):
    _hf_model(tmp_path / "hf", num_hidden_layers=2)
    tensors = safetensors.load_file(str(tmp_path / "hf" / HF_WEIGHTS))
    tensors["model.layers.2.enorm.weight"] = torch.ones(64)   # the hub's MTP module past num_hidden_layers
    safetensors.save_file(tensors, str(tmp_path / "hf" / HF_WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.2.enorm.weight: a layer past num_hidden_layers 2, a "
                                              "multi-token prediction module"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
