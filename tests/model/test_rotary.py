"""Rotary embeddings: the rotate-half pairing (channel i with i + d/2), relative positions, no state; Llama 3's
frequency scaling; positions after an offset (generation with a KV cache)."""

from __future__ import annotations

import math

import torch

from megalite.model.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies


def test_rotate_half_pairs_channel_i_with_i_plus_half():
    d, base, seq = 8, 10000, 5
    rope = RotaryEmbedding(d, base)
    q = torch.randn(1, 1, seq, d)
    rotated, _ = rope(q, q)
    # The same rotation written with complex numbers: z_i = q_i + j q_{i+d/2}, turned by position x base^(-2i/d).
    z = torch.complex(q[..., : d // 2].double(), q[..., d // 2:].double())
    angles = torch.arange(seq).double()[:, None] * base ** (-torch.arange(0, d, 2).double() / d)
    expected = z * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(rotated.double(), torch.cat([expected.real, expected.imag], dim=-1), atol=1e-6,
                               rtol=0)


def test_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(16, 10000)
    q, k = torch.randn(16).expand(1, 1, 6, 16), torch.randn(16).expand(1, 1, 6, 16)
    q, k = rope(q, k)
    scores = (q @ k.transpose(-1, -2))[0, 0]
    for offset in range(-5, 6):
        diagonal = scores.diagonal(offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), atol=1e-5, rtol=0)


def test_no_parameters_and_nothing_in_the_state_dict():
    rope = RotaryEmbedding(8, 10000)
    rope(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    assert not list(rope.parameters()) and not rope.state_dict()
    rope.to(torch.bfloat16)
    assert rope.cos_sin(4, torch.device("cpu"))[0].dtype == torch.float32   # cast only when applied


def test_llama3_scaling_keeps_high_divides_low_and_blends_between():
    """Llama 3.2's factors (32, 1, 4, 8192) at head dimension 64: every regime occurs; equal to Hugging Face's
    llama3 rope bit for bit when transformers is installed."""
    scaling = RopeScaling(32.0, 1.0, 4.0, 8192)
    plain, scaled = inverse_frequencies(64, 500000), inverse_frequencies(64, 500000, scaling)
    wavelength = 2 * math.pi / plain.double()
    high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 32)
    between = ~high & ~low
    blend = (8192 / wavelength[between] - 1) / (4 - 1)
    torch.testing.assert_close(scaled[between].double(), (1 - blend) * plain[between] / 32 + blend * plain[between])
    try:
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert torch.equal(scaled, ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0])


def test_an_offset_rotates_the_later_positions():
    rope = RotaryEmbedding(16, 10000, scaling=RopeScaling(8.0, 1.0, 4.0, 4))
    q = torch.randn(1, 2, 10, 16)
    whole, _ = rope(q, q)
    later, _ = rope(q[:, :, 6:], q[:, :, 6:], offset=6)
    assert torch.equal(later, whole[:, :, 6:])
