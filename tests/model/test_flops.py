"""MFU's two halves: the model FLOPs are Korthikanti et al.'s for GPT shapes, and each GPU name finds its dense bf16
peak (a PCIe H100 its own, not the SXM part's)."""

from __future__ import annotations

import pytest

from megalite.config import ModelConfig
from megalite.model.flops import model_flops_per_iteration, peak_bf16_tflops


def korthikanti_model_flops(global_batch_size: int, num_layers: int, seq_length: int, hidden_size: int,
                            vocab_size: int) -> float:
    """72 B L s h^2 (1 + s/(6h) + V/(12 h L)), Korthikanti et al. 2022 (GPT shapes: ffn 4h, no grouped queries)."""
    B, L, s, h, V = global_batch_size, num_layers, seq_length, hidden_size, vocab_size
    return 72.0 * B * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def test_model_flops_are_korthikanti_s_for_gpt_shapes():
    model = ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50257)
    assert model_flops_per_iteration(model, 512) == pytest.approx(
        korthikanti_model_flops(512, model.num_layers, model.seq_length, model.hidden_size, model.vocab_size))


def test_multi_token_prediction_adds_a_layer_a_projection_and_an_output_layer_per_depth():
    """Megatron's count: per depth a GPT layer (24 B s h^2 (1 + s/(6h))), the output layer again, and the 2h x h
    projection with the norms' 3h."""
    plain = ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=50257,
                        position_embedding_type="rope")
    B, s, h, V = 512, plain.seq_length, plain.hidden_size, plain.vocab_size
    depth = korthikanti_model_flops(B, 1, s, h, V) + 6.0 * B * s * (2 * h * h + 3 * h)
    mtp = ModelConfig(**{**plain.__dict__, "mtp_num_layers": 2})
    assert model_flops_per_iteration(mtp, B) == pytest.approx(model_flops_per_iteration(plain, B) + 2 * depth)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("Tesla V100-SXM2-16GB", None),
])
def test_peak_by_device_name(name, peak):
    assert peak_bf16_tflops(name) == peak
