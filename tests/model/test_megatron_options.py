"""The model options Megatron's scripts use, in one process and against Hugging Face where it has the architecture:
partial rotary (--rotary-percent) is StableLM's, zero-centred norms (--apply-layernorm-1p) are Llama's with the
weights plus one, --kv-channels gives attention of another head size (HF parity through the Llama importer:
tests/checkpoint/test_hf_llama.py), and --no-position-embedding leaves no position information at all.

Tolerance for logits against HF: 1e-5 relative to the largest logit (fp32), as the GPT-2 and Llama conversions."""

from __future__ import annotations

import pytest
import torch

from megalite.checkpoint import hf_llama
from megalite.model import GPTModel
from megalite.model.rotary import RotaryEmbedding
from megalite.tensor_parallel import TensorParallelRNG

from ..helpers import tiny_config

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py

RTOL = 1e-5
LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
         "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 176,
         "untie_embeddings_and_output_weights": True}


def _model(**options) -> GPTModel:
    model = GPTModel(tiny_config(model=options).model, TensorParallelRNG(0, 0, 0, torch.device("cpu"))).eval()
    model.initialize(seed=3)
    with torch.no_grad():   # norms start at exactly 1 (or 0) and biases at 0: noise so a wrong mapping shows
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 301, (2, 32), generator=torch.Generator().manual_seed(5))


def _hf_tensors(model: GPTModel, norm_offset: float = 0.0) -> dict[str, torch.Tensor]:
    """The model's canonical tensors under HF Llama names (StableLM uses the same ones), plus norm biases; the norm
    weights plus ``norm_offset``."""
    tensors = {name: p.detach() for name, p in model.canonical_named_parameters()}
    for name in ("embedding.word.weight", "output_layer.weight"):   # without the vocabulary padding
        tensors[name] = tensors[name][:model.cfg.vocab_size]
    result = {}
    for name, hf_names in hf_llama.name_map(model.cfg):
        blocks = tensors[name]
        rows = [hf_shape[0] for hf_shape in (hf_llama._hf_shapes(model.cfg)[hf_llama._suffix(h)] for h in hf_names)]
        offset = norm_offset if name.endswith("norm.weight") else 0.0
        result.update({h: block + offset for h, block in zip(hf_names, blocks.split(rows))})
    for name, hf in [("input_norm", "input_layernorm"), ("pre_mlp_norm", "post_attention_layernorm")]:
        for i in range(model.cfg.num_layers):
            if f"layers.{i}.{name}.bias" in tensors:
                result[f"model.layers.{i}.{hf}.bias"] = tensors[f"layers.{i}.{name}.bias"]
    if "final_norm.bias" in tensors:
        result["model.norm.bias"] = tensors["final_norm.bias"]
    return result


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_partial_rotary_rotates_the_first_channels_only():
    q, k = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 16)
    rotated_q, rotated_k = RotaryEmbedding(4, 10000)(q, k)
    full_q, full_k = RotaryEmbedding(4, 10000)(q[..., :4], k[..., :4])   # base^(-2i/4): frequencies of 4 channels
    assert torch.equal(rotated_q[..., :4], full_q) and torch.equal(rotated_k[..., :4], full_k)
    assert torch.equal(rotated_q[..., 4:], q[..., 4:]) and torch.equal(rotated_k[..., 4:], k[..., 4:])


def test_partial_rotary_is_stablelms():
    """rope on a quarter of each head, LayerNorm with biases, SwiGLU, grouped-query attention: HF's StableLM."""
    transformers = pytest.importorskip("transformers")
    model = _model(**{**LLAMA, "normalization": "LayerNorm", "rotary_percent": 0.25})
    config = transformers.StableLmConfig(
        vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, layer_norm_eps=1e-5, tie_word_embeddings=False,
        partial_rotary_factor=0.25, rope_theta=10000.0)
    hf = transformers.StableLmForCausalLM(config).eval()
    assert hf.model.rotary_emb.inv_freq.numel() == 2   # a rotated dimension of 4
    hf.load_state_dict(_hf_tensors(model), strict=True)
    with torch.no_grad():
        expected, actual = hf(_tokens()).logits, model.full_logits(_tokens())
    difference = _relative(actual, expected)
    print(f"--rotary-percent 0.25 vs HF StableLM: max rel logit diff {difference:.1e}")
    assert difference < RTOL
    # The test can fail: rotating every channel is another model.
    whole = _model(**{**LLAMA, "normalization": "LayerNorm"})
    whole.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert _relative(whole.full_logits(_tokens()), expected) > 1e-3


def test_zero_centred_norms_are_llama_with_weights_plus_one():
    transformers = pytest.importorskip("transformers")
    model = _model(**LLAMA, apply_layernorm_1p=True)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False)).eval()
    hf.load_state_dict(_hf_tensors(model, norm_offset=1.0), strict=True)
    with torch.no_grad():
        expected, actual = hf(_tokens()).logits, model.full_logits(_tokens())
    difference = _relative(actual, expected)
    print(f"--apply-layernorm-1p vs HF Llama with norm weights + 1: max rel logit diff {difference:.1e}")
    assert difference < RTOL
    fresh = GPTModel(tiny_config(model={**LLAMA, "apply_layernorm_1p": True}).model, None)
    fresh.initialize(seed=3)
    assert all(torch.count_nonzero(p) == 0 for n, p in fresh.named_parameters() if "norm" in n)


def test_layernorm_1p_starts_as_the_plain_layernorm():
    plain, centred = _model(), _model(apply_layernorm_1p=True)
    with torch.no_grad():
        for (name, a), b in zip(plain.named_parameters(), centred.parameters()):
            b.copy_(a - 1 if "norm" in name and name.endswith("weight") else a)
        assert torch.allclose(plain.full_logits(_tokens()), centred.full_logits(_tokens()), atol=1e-6, rtol=0)


def test_kv_channels_sets_the_head_size():
    model = _model(**LLAMA, kv_channels=32)   # hidden 64 / 4 heads would be 16
    attention = model.layers[0].self_attention
    assert attention.linear_qkv.weight.shape == (4 * 32 + 2 * 2 * 32, 64)
    assert attention.linear_proj.weight.shape == (64, 4 * 32)
    assert model.full_logits(_tokens()).shape == (2, 32, 301)


def test_no_position_embedding_has_no_positions():
    model = _model(no_position_embedding=True)
    assert model.embedding.position is None
    assert not any("position" in name for name, _ in model.named_parameters())
    # Causal attention alone still tells positions apart: a token's logits depend on what precedes it only.
    tokens = _tokens()
    shifted = tokens.clone()
    shifted[:, 20:] = (shifted[:, 20:] + 1) % 301
    with torch.no_grad():
        a, b = model.full_logits(tokens), model.full_logits(shifted)
    assert torch.equal(a[:, :20], b[:, :20]) and not torch.equal(a[:, 20:], b[:, 20:])
