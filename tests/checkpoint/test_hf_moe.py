"""Hugging Face mixtures of experts: Mixtral, Qwen2-MoE (shared expert with its gate, dense layers, top-k without
renormalization) and Qwen3-MoE (per-head q/k norms, head dimension other than hidden / heads) import and export
with the same logits (tiny random models built locally, odd vocabulary 301; tolerance 1e-5 relative to the largest
logit), from the per-expert files the hub holds and from transformers 5's fused experts; what megalite would compute
differently is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from megalite import load_pretrained
from megalite.checkpoint import CheckpointError
from megalite.checkpoint.convert import HF_WEIGHTS, export_hf, import_hf
from megalite.checkpoint.hf_moe import architecture, check_exportable

from ..helpers import TINY_MOE, tiny_config
from .helpers import perturb_and_save, train_and_save

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

RTOL = 1e-5
VOCAB = 301
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
          "rope_theta": 1000000.0, "num_experts_per_tok": 2, "tie_word_embeddings": False}
MODELS = {
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32,
                                          "shared_expert_intermediate_size": 40, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32, "head_dim": 32,
                                          "norm_topk_prob": True, "tie_word_embeddings": True}),
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_model(kind: str, **overrides):
    name, options = MODELS[kind]
    config = getattr(transformers, name.replace("ForCausalLM", "Config"))(**{**COMMON, **options, **overrides})
    torch.manual_seed(5)
    return getattr(transformers, name)(config).eval()


def _logits(model, seed: int, hf: bool = False) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(tokens).logits if hf else model(tokens)


@pytest.mark.parametrize("kind, overrides", [("mixtral", {}), ("qwen2_moe", {}), ("qwen2_moe", {"qkv_bias": False}),
                                             ("qwen3_moe", {})])
def test_import_and_export_give_the_same_logits(tmp_path, kind, overrides):
    """Qwen2-MoE's q/k/v biases (perturbed, not zero) are --add-qkv-bias; without them (qkv_bias false) none."""
    hf = perturb_and_save(_hf_model(kind, **overrides), tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_pretrained(tmp_path / "ckpt")
    imported = model.config.model
    assert architecture(imported) == MODELS[kind][0]
    assert imported.add_qkv_bias == (kind == "qwen2_moe" and overrides.get("qkv_bias", True))
    into = _relative(_logits(model, 0), _logits(hf, 0, hf=True))
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == MODELS[kind][0]
    out_of = _relative(_logits(back, 1, hf=True), _logits(model, 1))
    print(f"{kind}: HF -> megalite max rel logit diff {into:.1e}, megalite -> HF {out_of:.1e}")
    assert into < RTOL and out_of < RTOL


def test_qwen_options_map_to_megalite_s():
    qwen2 = _hf_model("qwen2_moe").config.to_dict()
    from megalite.checkpoint.hf_moe import model_config_from

    model = model_config_from(qwen2)
    assert model.moe_layers() == [True, False, True] and model.moe_router_pre_softmax
    assert (model.moe_shared_expert_intermediate_size, model.moe_shared_expert_gate) == (40, True)
    qwen3 = model_config_from(_hf_model("qwen3_moe").config.to_dict())
    assert (qwen3.kv_channels, qwen3.qk_layernorm, qwen3.moe_router_pre_softmax) == (32, True, False)


def test_transformers_5_fused_experts_import_too(tmp_path):
    hf = perturb_and_save(_hf_model("mixtral"), tmp_path / "hf")
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    safetensors.save_file(fused, str(tmp_path / "hf" / HF_WEIGHTS), metadata={"format": "pt"})
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert _relative(_logits(load_pretrained(tmp_path / "ckpt"), 0), _logits(hf, 0, hf=True)) < RTOL


def test_a_trained_megalite_mixture_exports_as_mixtral(tmp_path):
    llama = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
             "disable_bias_linear": True, "untie_embeddings_and_output_weights": True}
    cfg = tiny_config(model={**TINY_MOE, **llama, "moe_grouped_gemm": True}, data={"eval_interval": 0})
    train_and_save(cfg, tmp_path / "ckpt", 1)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"], config["intermediate_size"]) == \
        (["MixtralForCausalLM"], 4, 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    difference = _relative(_logits(hf, 2, hf=True), _logits(load_pretrained(tmp_path / "ckpt"), 2))
    print(f"trained megalite MoE -> HF Mixtral: max rel logit diff {difference:.1e}")
    assert difference < RTOL


@pytest.mark.parametrize("kind, overrides, message", [
    ("mixtral", {"sliding_window": 16}, "sliding_window 16 is not supported"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window is not supported"),
])
def test_import_refuses_what_megalite_would_compute_differently(tmp_path, kind, overrides, message):
    perturb_and_save(_hf_model(kind, **overrides), tmp_path / "hf")
    with pytest.raises(CheckpointError, match=message):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


@pytest.mark.parametrize("options, message", [
    ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
     "moe_router_score_function='sigmoid' has no MixtralForCausalLM counterpart"),
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True has no MixtralForCausalLM counterpart"),
    ({"moe_shared_expert_intermediate_size": 48}, "moe_shared_expert_gate=False has no Qwen2MoeForCausalLM"),
    ({"swiglu": False}, "swiglu=False (it needs swiglu=True)"),
])
def test_export_refuses_what_hugging_face_would_compute_differently(options, message):
    llama = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
             "disable_bias_linear": True}
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_exportable(tiny_config(model={**TINY_MOE, **llama, **options}).model)
