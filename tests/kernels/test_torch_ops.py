"""The fused ops' autograd functions run through megalite.kernels.torch_ops (the kernels' functions in torch ops)
equal the plain torch composition the model uses, forward and backward.

fp32 on CPU, tolerance rtol 1e-5 / atol 1e-6 (measured: a few ulp; the manual backward formulas sum in another order
than autograd). The kernels themselves are checked against float64 by tools/gpu_check.py on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megalite.kernels import fused, torch_ops
from megalite.model.rotary import RotaryEmbedding, rotate_half
from megalite.tensor_parallel.cross_entropy import _FusedVocabParallelCrossEntropy, _VocabParallelCrossEntropy

TOL = dict(rtol=1e-5, atol=1e-6)

pytestmark = pytest.mark.usefixtures("single_process_layout")   # tests/conftest.py


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _compare(ours_fn, reference_fn, inputs, grad_out=None, tol=TOL):
    """Run both on separate copies of ``inputs``: outputs and every input's gradient agree."""
    ours_in, reference_in = _leaves(*inputs), _leaves(*inputs)
    ours, reference = ours_fn(*ours_in), reference_fn(*reference_in)
    torch.testing.assert_close(ours, reference, **tol)
    grad_out = torch.randn_like(reference) if grad_out is None else grad_out
    (ours * grad_out).sum().backward()
    (reference * grad_out).sum().backward()
    for a, b in zip(ours_in, reference_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **tol)


def test_masked_softmax_is_a_causal_softmax_of_the_scaled_scores():
    scale = 0.125
    x = torch.randn(2, 3, 17, 17) * 4

    def reference(x):
        mask = torch.ones(17, 17, dtype=torch.bool).triu(1)
        return torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)

    _compare(lambda x: fused.scaled_masked_softmax(x, scale), reference, [x])
    y = fused.scaled_masked_softmax(x, scale)
    assert torch.equal(y.triu(1), torch.zeros_like(y))   # exactly zero above the diagonal


@pytest.mark.parametrize("tanh", [False, True])
def test_bias_gelu_is_gelu_of_the_sum(tanh):
    x, bias = torch.randn(3, 5, 24) * 3, torch.randn(24)
    approximate = "tanh" if tanh else "none"
    _compare(lambda x, b: fused.bias_gelu(x, b, tanh=tanh), lambda x, b: F.gelu(x + b, approximate=approximate),
             [x, bias])


def test_layer_norm_is_torch_layer_norm():
    x, weight, bias = torch.randn(4, 7, 48) * 2 + 1, torch.randn(48), torch.randn(48)
    _compare(lambda x, w, b: fused.layer_norm(x, w, b, 1e-5), lambda x, w, b: F.layer_norm(x, (48,), w, b, 1e-5),
             [x, weight, bias])


def test_rms_norm_is_torch_rms_norm():
    x, weight = torch.randn(4, 7, 48) * 2, torch.randn(48)
    _compare(lambda x, w: fused.rms_norm(x, w, 1e-5), lambda x, w: F.rms_norm(x, (48,), w, 1e-5), [x, weight])


def test_rotary_is_the_models_rotation_and_accepts_strided_queries():
    batch, seq, heads, dim = 2, 9, 3, 16
    cos, sin = RotaryEmbedding(dim, 10000).cos_sin(seq, torch.device("cpu"))
    # As in the model: a [batch, seq, heads, dim] projection viewed as [batch, heads, seq, dim] (not contiguous).
    x = torch.randn(batch, seq, heads, dim)
    _compare(lambda x: fused.rotary(x.transpose(1, 2), cos, sin),
             lambda x: x.transpose(1, 2) * cos + rotate_half(x.transpose(1, 2)) * sin, [x])
    assert fused.rotary(x.transpose(1, 2), cos, sin).is_contiguous()


@pytest.mark.parametrize("vocab", [301, 384])   # with and without padding columns
def test_fused_cross_entropy_is_cross_entropy(vocab):
    padded = 384
    logits, target = torch.randn(3, 5, padded) * 3, torch.randint(vocab, (3, 5))
    _compare(lambda x: _FusedVocabParallelCrossEntropy.apply(x, target, vocab, torch_ops),
             lambda x: F.cross_entropy(x[..., :vocab].transpose(1, 2), target, reduction="none"), [logits])
    _compare(lambda x: _FusedVocabParallelCrossEntropy.apply(x, target, vocab, torch_ops),
             lambda x: _VocabParallelCrossEntropy.apply(x, target, vocab), [logits])


def test_cross_entropy_stats_of_a_slice_without_the_target_or_any_valid_column():
    logits = torch.randn(4, 8)
    target = torch.tensor([-3, 0, 7, 8])   # before, first, last, after this slice
    row_max, sum_exp, target_logit = torch_ops.cross_entropy_stats(logits, target, 8)
    torch.testing.assert_close(row_max, logits.max(dim=-1).values)
    torch.testing.assert_close(sum_exp, (logits - row_max[:, None]).exp().sum(dim=-1))
    torch.testing.assert_close(target_logit, torch.stack([torch.tensor(0.0), logits[1, 0], logits[2, 7],
                                                          torch.tensor(0.0)]))
    row_max, sum_exp, _ = torch_ops.cross_entropy_stats(logits, target, 0)   # all padding
    assert torch.equal(row_max, torch.full((4,), float("-inf"))) and torch.equal(sum_exp, torch.zeros(4))


@pytest.mark.parametrize("name", ["masked_softmax", "bias_gelu", "bias_tanh_gelu", "layer_norm", "rms_norm", "rotary",
                                  "cross_entropy"])
def test_bf16_inputs_compute_in_fp32_and_return_bf16(name):
    """bf16 in, bf16 out, within bf16 rounding (rtol 1e-2) of the fp32 composition on the same bf16 values."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16, 16).to(torch.bfloat16)
    w, b = torch.randn(16).to(torch.bfloat16), torch.randn(16).to(torch.bfloat16)
    cos, sin = RotaryEmbedding(16, 10000).cos_sin(16, torch.device("cpu"))
    target = torch.randint(16, (2, 4, 16))
    cases = {
        "masked_softmax": (lambda x: fused.scaled_masked_softmax(x, 0.25),
                           lambda x: torch.softmax((x * 0.25).masked_fill(torch.ones(16, 16).bool().triu(1),
                                                                           float("-inf")), dim=-1)),
        "bias_gelu": (lambda x: fused.bias_gelu(x, b), lambda x: F.gelu(x + b.float())),
        "bias_tanh_gelu": (lambda x: fused.bias_gelu(x, b, tanh=True),
                           lambda x: F.gelu(x + b.float(), approximate="tanh")),
        "layer_norm": (lambda x: fused.layer_norm(x, w, b, 1e-5),
                       lambda x: F.layer_norm(x, (16,), w.float(), b.float(), 1e-5)),
        "rms_norm": (lambda x: fused.rms_norm(x, w, 1e-5), lambda x: F.rms_norm(x, (16,), w.float(), 1e-5)),
        "rotary": (lambda x: fused.rotary(x, cos, sin), lambda x: x * cos + rotate_half(x) * sin),
        "cross_entropy": (lambda x: _FusedVocabParallelCrossEntropy.apply(x, target, 16, torch_ops),
                          lambda x: F.cross_entropy(x.flatten(0, 2), target.flatten(), reduction="none").view(
                              2, 4, 16)),
    }
    ours_fn, reference_fn = cases[name]
    ours_x, reference_x = _leaves(x, x.float())
    ours, reference = ours_fn(ours_x), reference_fn(reference_x)
    assert ours.dtype == (torch.float32 if name == "cross_entropy" else torch.bfloat16)
    torch.testing.assert_close(ours.float(), reference, rtol=1e-2, atol=1e-2)
    grad = torch.randn_like(reference)
    (ours.float() * grad).sum().backward()
    (reference * grad).sum().backward()
    assert ours_x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours_x.grad.float(), reference_x.grad, rtol=1e-2, atol=1e-2)
