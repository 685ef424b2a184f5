"""Autograd functions of the fused ops, each running on ``ops``: the CUDA extension, or :mod:`torch_ops` (the same
functions in torch ops, for the CPU tests and as the kernels' specification).

Each function saves only what its kernel's backward reads (LayerNorm: the input and two fp32 numbers per row, not
the normalized tensor; the masked softmax: its output, not its input) and casts parameters to the input's dtype
(a no-op in the model, whose parameters and activations share a dtype) because the kernels take one dtype; parameter
gradients come back in fp32 and are cast to the parameter's dtype.

Which ``ops`` a call gets is decided by :class:`megalite.kernels.policy.KernelPolicy`; the model calls these only when
the policy picks the extension, and its plain torch ops otherwise.
"""

from __future__ import annotations

import types

import torch

from megalite.kernels import torch_ops

Ops = types.ModuleType   # the extension module or megalite.kernels.torch_ops: the same functions


def _in_dtype_of(param: torch.Tensor, x: torch.Tensor, ops: Ops) -> torch.Tensor:
    """A parameter as ``ops`` takes it: the kernels in the input's dtype; the torch ops as it is (so that the RMSNorm
    the model runs through them computes exactly what it always did, even with an fp32 weight and a bf16 input)."""
    return param if ops is torch_ops else param.to(x.dtype)


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, ops):
        y = ops.masked_softmax_forward(x, scale)
        ctx.save_for_backward(y)
        ctx.scale, ctx.ops = scale, ops
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (y,) = ctx.saved_tensors
        return ctx.ops.masked_softmax_backward(grad_y, y, ctx.scale), None, None


def scaled_masked_softmax(x: torch.Tensor, scale: float, ops: Ops = torch_ops) -> torch.Tensor:
    """softmax(scale * x) over the last dimension with a causal mask (query i sees keys 0..i); x [..., s, s]."""
    *batch, sq, sk = x.shape
    return _MaskedSoftmax.apply(x.reshape(-1, sq, sk), scale, ops).view(*batch, sq, sk)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, ops, tanh):
        ctx.ops, ctx.bias_dtype, ctx.tanh = ops, bias.dtype, tanh
        bias = _in_dtype_of(bias, x, ops)
        ctx.save_for_backward(x, bias)
        return ops.bias_gelu_forward(x, bias, tanh)

    @staticmethod
    def backward(ctx, grad_y):
        x, bias = ctx.saved_tensors
        grad_x = ctx.ops.bias_gelu_backward(grad_y, x, bias, ctx.tanh)
        grad_bias = None
        if ctx.needs_input_grad[1]:   # summed over tokens in fp32, then rounded once
            grad_bias = grad_x.reshape(-1, x.shape[-1]).sum(dim=0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_bias, None, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, ops: Ops = torch_ops, tanh: bool = False) -> torch.Tensor:
    """gelu(x + bias), bias [n] broadcast over x [..., n]: the exact GeLU, or with ``tanh`` its tanh approximation
    (``F.gelu(approximate="tanh")``, Megatron's fused bias-GeLU)."""
    return _BiasGelu.apply(x, bias, ops, tanh)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, ops):
        y, mean, rstd = ops.layer_norm_forward(x, _in_dtype_of(weight, x, ops), _in_dtype_of(bias, x, ops), eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.ops, ctx.bias_dtype = ops, bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, mean, rstd = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = ctx.ops.layer_norm_backward(grad_y, x, _in_dtype_of(weight, x, ctx.ops),
                                                                     mean, rstd)
        return grad_x, grad_weight.to(weight.dtype), grad_bias.to(ctx.bias_dtype), None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               ops: Ops = torch_ops) -> torch.Tensor:
    """LayerNorm over the last dimension (biased variance, as torch's), with a weight and a bias."""
    return _LayerNorm.apply(x, weight, bias, eps, ops)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, ops):
        y, rstd = ops.rms_norm_forward(x, _in_dtype_of(weight, x, ops), eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.ops = ops
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = ctx.ops.rms_norm_backward(grad_y, x, _in_dtype_of(weight, x, ctx.ops), rstd)
        return grad_x, grad_weight.to(weight.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: Ops = torch_ops) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, in fp32 whatever x's dtype; keeps x and the
    per-row rstd for backward. With the torch ops this is exactly the model's RMSNorm on CPU (the weight is used in
    its own dtype there, as it always was)."""
    return _RMSNorm.apply(x, weight, eps, ops)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, ops):
        ctx.save_for_backward(cos, sin)
        ctx.ops = ops
        return ops.rope_forward(x, cos, sin)

    @staticmethod
    def backward(ctx, grad_y):
        cos, sin = ctx.saved_tensors
        return ctx.ops.rope_backward(grad_y, cos, sin), None, None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: Ops = torch_ops) -> torch.Tensor:
    """Rotate x [batch, heads, seq, dim] by the angles whose fp32 cos and sin [seq, dim] are given (rotate-half
    convention); the result is contiguous."""
    return _Rotary.apply(x, cos, sin, ops)
