"""Hugging Face DeepSeek-V3 (multi-latent attention with and without the query's low-rank projection, interleaved
rotary channels, yarn with mscale_all_dim, group-limited sigmoid routing with the score-correction bias, a routed
scaling factor, shared experts, a dense first layer) imports and exports with the same logits (tiny random models,
odd vocabulary 301; tolerance 1e-5 relative to the largest logit) and the same greedy generation through the latent
KV cache; DeepSeek's multi-token-prediction layers import and export bit for bit (a directory transformers saved,
without them, imports without MTP)."""

from __future__ import annotations

import json

import pytest
import torch

from megalite.checkpoint import CheckpointError, open_checkpoint
from megalite.checkpoint.convert import HF_WEIGHTS, export_hf, full_tensors, import_hf

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
    # transformers' config keeps num_nextn_predict_layers (1 by default) but its model saves no such module.
    assert hf.config.num_nextn_predict_layers == 1 and imported.mtp_num_layers is None
    assert (imported.moe_router_num_groups, imported.moe_router_group_topk, imported.moe_layers()) == (
        4, 2, [False, True, True])
    assert_greedy_matches(model, hf, [5, 17, 300, 2], 12)
    assert_export_matches(tmp_path / "ckpt", tmp_path / "out", f"deepseek_v3 {overrides}")


def _add_mtp_layers(directory, depth: int) -> dict[str, torch.Tensor]:
    """Store ``depth`` multi-token prediction modules past the model's layers as DeepSeek's checkpoints do (the copies
    of embed_tokens and lm_head included): module k's decoder-layer tensors are the last layer's times k + 2 plus 0.5
    (so its canonical tensors are the last layer's canonical ones under the same map, whatever rows conversion
    reorders), its enorm, hnorm, eh_proj and shared_head.norm random; the tensors written."""
    tensors = safetensors.load_file(str(directory / HF_WEIGHTS))
    last = 1   # the tiny model's two layers: dense, then MoE
    generator = torch.Generator().manual_seed(7)
    for k in range(depth):
        prefix = f"model.layers.{2 + k}."
        tensors.update({name.replace(f"model.layers.{last}.", prefix): t * (k + 2) + 0.5 for name, t in tensors.items()
                        if name.startswith(f"model.layers.{last}.")})
        for name, shape in (("enorm.weight", [64]), ("hnorm.weight", [64]), ("eh_proj.weight", [64, 128]),
                            ("shared_head.norm.weight", [64])):
            tensors[prefix + name] = torch.randn(shape, generator=generator)
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    safetensors.save_file(tensors, str(directory / HF_WEIGHTS), metadata={"format": "pt"})
    return tensors


def test_multi_token_prediction_imports_and_exports(tmp_path):
    """DeepSeek's MTP modules (model.layers.{N+k}: an MoE layer like the last, enorm, hnorm, eh_proj, shared_head)
    import as mtp.layers.k with the model's logits still transformers' (which ignores them), and export back bit for
    bit with num_nextn_predict_layers; stored modules the config does not count, or a shared_head.head other than
    lm_head, are refused in one line."""
    hf = _hf_model(tmp_path / "hf", num_hidden_layers=2, num_nextn_predict_layers=2)
    written = _add_mtp_layers(tmp_path / "hf", 2)
    model = assert_import_matches(hf, tmp_path / "hf", tmp_path / "ckpt", "deepseek_v3 with MTP")
    assert model.config.model.mtp_num_layers == 2
    canonical = full_tensors(open_checkpoint(tmp_path / "ckpt"))
    for k in range(2):
        for name, hf_name in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                              ("final_norm", "shared_head.norm")):
            assert torch.equal(canonical[f"mtp.layers.{k}.{name}.weight"],
                               written[f"model.layers.{2 + k}.{hf_name}.weight"])
        layer = {name[len(f"mtp.layers.{k}.transformer_layer."):]: t for name, t in canonical.items()
                 if name.startswith(f"mtp.layers.{k}.transformer_layer.")}
        assert layer.keys() == {name[len("layers.1."):] for name in canonical if name.startswith("layers.1.")}
        assert "mlp.experts.7.linear_fc1.weight" in layer and "self_attention.linear_q_up_proj.weight" in layer
        for name, t in layer.items():
            assert torch.equal(t, canonical[f"layers.1.{name}"] * (k + 2) + 0.5), name
    export_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
    exported = safetensors.load_file(str(tmp_path / "out" / HF_WEIGHTS))
    assert exported.keys() == written.keys() and all(torch.equal(exported[n], t) for n, t in written.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 2

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match=r"^the weights store layers 2, 3 past num_hidden_layers 2 \(multi-token "
                                              r"prediction modules\), but num_nextn_predict_layers is 1$"):
        import_hf(tmp_path / "hf", tmp_path / "refused")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    written["model.layers.3.shared_head.head.weight"] = written["lm_head.weight"] + 1
    safetensors.save_file(written, str(tmp_path / "hf" / HF_WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"^model.layers.3.shared_head.head.weight differs from lm_head.weight "):
        import_hf(tmp_path / "hf", tmp_path / "refused")
