"""Rotary embeddings: the rotate-half pairing (channel i with i + d/2), relative positions, no state."""

from __future__ import annotations

import torch

from megalite.model.rotary import RotaryEmbedding


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
