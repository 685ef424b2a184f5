"""RMSNorm: torch's reference values and gradients, fp32 statistics, and only the input and 1/rms kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.model.norms import RMSNorm, norm


def test_rms_norm_matches_torch():
    x = torch.randn(3, 5, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    grad = torch.randn(3, 5, 16)
    module = RMSNorm(16, 1e-5)
    with torch.no_grad():
        module.weight.copy_(weight)
    ours = module(x)
    (ours * grad).sum().backward()
    ours_x, ours_w = x.grad.clone(), module.weight.grad.clone()
    x.grad = None
    reference = F.rms_norm(x, (16,), weight, 1e-5)
    (reference * grad).sum().backward()
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_x, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_w, weight.grad, atol=1e-5, rtol=1e-5)


def test_rms_norm_keeps_the_input_and_statistics_only_and_computes_in_fp32():
    module = RMSNorm(16, 1e-5).to(torch.bfloat16)
    x = torch.randn(2, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = module(x)
    assert y.dtype == torch.bfloat16
    shapes = sorted(tuple(t.shape) for t in saved if t is not module.weight)
    assert shapes == [(2, 4, 1), (2, 4, 16)]
    expected = F.rms_norm(x.float(), (16,), module.weight.float(), 1e-5).to(torch.bfloat16)
    assert torch.equal(y, expected)


def test_norm_follows_the_config_and_flags_sequence_parallel_parameters():
    rms = norm(ModelConfig(normalization="RMSNorm"), sequence_parallel=True)
    assert isinstance(rms, RMSNorm) and [name for name, _ in rms.named_parameters()] == ["weight"]
    assert rms.weight.sequence_parallel
    layer_norm = norm(ModelConfig())
    assert isinstance(layer_norm, torch.nn.LayerNorm)
    assert not any(getattr(p, "sequence_parallel", False) for p in layer_norm.parameters())


def test_zero_centred_rms_norm_adds_one_in_fp32_as_gemma():
    """--apply-layernorm-1p in bf16 is Gemma's RMSNorm bit for bit: (x / rms(x)) * (1 + w) in fp32, rounded once (1 + w
    rounded to bf16 first would lose most of a small w); its gradient reaches the bf16 weight."""
    module = RMSNorm(64, 1e-6, zero_centered=True).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(64) * 0.01)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    x32 = x.float()
    gemma = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + module.weight.float()))
    y = module(x)
    assert torch.equal(y, gemma.to(torch.bfloat16))
    y.float().sum().backward()
    assert module.weight.grad.dtype == torch.bfloat16
