"""Rotary embeddings: the rotate-half pairing (channel i with i + d/2), relative positions, no state; Llama 3's,
linear and YaRN frequency scaling (equal to transformers' bit for bit); positions after an offset (generation with a
KV cache)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megalite.model.rotary import (LinearScaling, Llama3Scaling, RotaryEmbedding, YarnScaling, inverse_frequencies,
                                   rope_scaling)

from ..helpers import tiny_config


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
    scaling = Llama3Scaling(32.0, 1.0, 4.0, 8192)
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
    rope = RotaryEmbedding(16, 10000, scaling=Llama3Scaling(8.0, 1.0, 4.0, 4))
    q = torch.randn(1, 2, 10, 16)
    whole, _ = rope(q, q)
    later, _ = rope(q[:, :, 6:], q[:, :, 6:], offset=6)
    assert torch.equal(later, whole[:, :, 6:])


# (head dim, base, factor, original context, beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor)
YARN_CASES = [(64, 10000, 4.0, 2048, 32.0, 1.0, 1.0, 0.0, None),    # Qwen2.5's: attention factor 0.1 ln 4 + 1
              (128, 1000000, 40.0, 4096, 32.0, 1.0, 1.0, 1.0, None),   # DeepSeek-V3's mscale ratio (here 1)
              (32, 10000, 2.5, 64, 16.0, 2.0, 1.2, 0.8, None),   # a ratio other than 1; a ramp over a few channels
              (16, 500000, 8.0, 16, 32.0, 1.0, 1.0, 0.0, 0.9),   # attention factor given; every channel ramped
              (64, 150000, 32.0, 4096, 32.0, 1.0, 1.0, 0.0, None, False)]   # gpt-oss': the range's bounds unrounded


@pytest.mark.parametrize("head_dim, base, factor, original, beta_fast, beta_slow, mscale, mscale_all_dim, attention, "
                         "rounded", [case + (True,) * (10 - len(case)) for case in YARN_CASES])
def test_yarn_equals_transformers(head_dim, base, factor, original, beta_fast, beta_slow, mscale, mscale_all_dim,
                                  attention, rounded):
    """Frequencies and attention factor bit for bit those of transformers' yarn init function (``rounded`` false:
    its truncate false); the frequencies between the kept (beta_fast) and the divided (beta_slow) ones."""
    scaling = YarnScaling(factor, original, beta_fast, beta_slow, mscale, mscale_all_dim, attention, rounded)
    plain, scaled = inverse_frequencies(head_dim, base), inverse_frequencies(head_dim, base, scaling)
    assert torch.all(scaled <= plain) and torch.all(scaled >= plain / factor * (1 - 1e-6))
    rotations = original * plain.double() / (2 * math.pi)
    assert torch.equal(scaled[rotations > beta_fast * 2], plain[rotations > beta_fast * 2])
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = {"rope_type": "yarn", "rope_theta": float(base), "factor": factor,
            "original_max_position_embeddings": original, "beta_fast": beta_fast, "beta_slow": beta_slow}
    if mscale_all_dim:
        rope.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    if attention is not None:
        rope["attention_factor"] = attention
    if not rounded:
        rope["truncate"] = False
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=rope,
                                      max_position_embeddings=int(original * factor))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.equal(scaled, inv_freq) and scaling.attention_factor == attention_factor
    assert attention_factor != 1 or mscale_all_dim   # the cases exercise the factor


@pytest.mark.parametrize("head_dim, base, factor", [(64, 10000, 2.0), (16, 500000, 3.0), (128, 1000000, 7.5)])
def test_linear_scaling_equals_transformers(head_dim, base, factor):
    scaled = inverse_frequencies(head_dim, base, LinearScaling(factor))
    torch.testing.assert_close(scaled, inverse_frequencies(head_dim, base) / factor, rtol=0, atol=0)
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters={
        "rope_type": "linear", "rope_theta": float(base), "factor": factor})
    assert torch.equal(scaled, ROPE_INIT_FUNCTIONS["linear"](config, "cpu")[0])


def test_yarn_attention_factor_scales_cos_and_sin_and_options_pick_the_scaling():
    """cos and sin carry the attention factor (q.k scaled by its square), as transformers' rotary embedding does;
    --rope-scaling-type picks the scaling, llama3 when unset (configs saved before the option)."""
    yarn = YarnScaling(4.0, 16, 32.0, 1.0, 1.0, 0.0)
    plain = RotaryEmbedding(16, 10000, scaling=dataclasses.replace(yarn, attention_factor_override=1.0))
    scaled = RotaryEmbedding(16, 10000, scaling=yarn)
    cos, sin = scaled.cos_sin(8, torch.device("cpu"))
    assert torch.equal(cos, plain.cos_sin(8, torch.device("cpu"))[0] * (0.1 * math.log(4) + 1))
    assert torch.equal(sin, plain.cos_sin(8, torch.device("cpu"))[1] * (0.1 * math.log(4) + 1))
    rope = {"position_embedding_type": "rope", "use_rope_scaling": True}
    assert isinstance(rope_scaling(tiny_config(model=rope).model), Llama3Scaling)
    assert rope_scaling(tiny_config(model={**rope, "rope_scaling_type": "linear"}).model) == LinearScaling(8.0)
    assert rope_scaling(tiny_config(model={**rope, "rope_scaling_type": "yarn", "beta_fast": 16.0}).model) == \
        YarnScaling(8.0, 8192, 16.0, 1.0, 1.0, 0.0, None)
    assert rope_scaling(tiny_config(model={"position_embedding_type": "rope"}).model) is None
