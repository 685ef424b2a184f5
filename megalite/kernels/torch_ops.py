"""The fused CUDA kernels' functions in plain torch ops: the same names, arguments and results as the extension built
from ``csrc/fused_ops.cpp``, computed the same way (fp32 arithmetic whatever the input dtype, fp32 statistics).

The autograd functions of :mod:`megalite.kernels.fused` take either this module or the extension as their ``ops``,
so the CPU tests run those functions (their saved tensors, backward formulas and dtype handling) through these ops
and compare them with the plain torch composition the model uses, and ``tools/gpu_check.py`` checks the kernels
against a float64 reference of that composition. The model's CPU path itself runs the plain composition (torch's
``F.layer_norm``, ``F.gelu``, ...), not these: they are the kernels' specification, not a faster fallback.
"""

from __future__ import annotations

import torch


# ---- scaled upper-triangular masked softmax: x [batches, sq, sk], row i sees keys 0..i ----

def _causal_mask(x: torch.Tensor) -> torch.Tensor:
    sq, sk = x.shape[-2:]
    return torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)   # True above the diagonal: masked


def masked_softmax_forward(x: torch.Tensor, scale: float) -> torch.Tensor:
    scores = (x.float() * scale).masked_fill(_causal_mask(x), float("-inf"))
    return torch.softmax(scores, dim=-1).to(x.dtype)


def masked_softmax_backward(grad_y: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    g, p = grad_y.float(), y.float()
    return (scale * p * (g - (g * p).sum(dim=-1, keepdim=True))).to(y.dtype)


# ---- bias + GeLU, exact (erf) or tanh approximation: x [..., n], bias [n] ----

_SQRT_2_OVER_PI = (2.0 / torch.pi) ** 0.5
_TANH_CUBIC = 0.044715


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor, tanh: bool = False) -> torch.Tensor:
    return torch.nn.functional.gelu(x.float() + bias.float(), approximate="tanh" if tanh else "none").to(x.dtype)


def bias_gelu_backward(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, tanh: bool = False) -> torch.Tensor:
    u = x.float() + bias.float()
    if tanh:   # d/du of u/2 (1 + tanh(k (u + c u^3))): (1 + t)/2 + u/2 (1 - t^2) k (1 + 3 c u^2)
        t = torch.tanh(_SQRT_2_OVER_PI * (u + _TANH_CUBIC * u * u * u))
        derivative = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * u * u)
    else:      # Phi(u) + u phi(u)
        cdf = 0.5 * (1.0 + torch.erf(u * 0.5**0.5))
        pdf = torch.exp(-0.5 * u * u) * (2.0 * torch.pi) ** -0.5
        derivative = cdf + u * pdf
    return (grad_y.float() * derivative).to(x.dtype)


# ---- LayerNorm and RMSNorm over the last dimension; statistics [..., 1] fp32, parameter gradients fp32 ----

def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x32 = x.float()
    mean = x32.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((x32 - mean).pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (x32 - mean) * rstd * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def layer_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                        rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x_hat = (x.float() - mean) * rstd
    grad32 = grad_y.float()
    g = grad32 * weight.float()
    grad_x = rstd * (g - g.mean(dim=-1, keepdim=True) - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
    grad_weight = (grad32 * x_hat).reshape(-1, n).sum(dim=0)
    grad_bias = grad32.reshape(-1, n).sum(dim=0)
    return grad_x.to(x.dtype), grad_weight, grad_bias


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The model's RMSNorm runs through these two functions on every device without the kernel, so they are written
    # op for op as it always computed them: x * rsqrt(mean(x^2) + eps) * weight.
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype), rstd


def rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    normalized = x.float() * rstd
    grad32 = grad_y.float()
    grad_weight = (grad32 * normalized).reshape(-1, x.shape[-1]).sum(dim=0)
    scaled = grad32 * weight.float()
    # d/dx of x * rstd: rstd * (g - x_hat * mean(g * x_hat)), g = grad * weight
    grad_x = rstd * (scaled - normalized * (scaled * normalized).mean(dim=-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight


# ---- rotary embedding, rotate-half convention: x [batch, heads, seq, dim], cos and sin [seq, dim] fp32 ----

def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-second, first], dim=-1) * sin).contiguous().to(x.dtype)


def rope_backward(grad_y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The transpose of y = x cos + rotate_half(x) sin: grad_x = g cos + rotate_half^T(g sin), rotate_half^T(u) =
    # [u2, -u1] (a rotation by minus the angle when cos and sin are the same for both halves, as they are).
    g32 = grad_y.float()
    first, second = (g32 * sin).chunk(2, dim=-1)
    return (g32 * cos + torch.cat([second, -first], dim=-1)).contiguous().to(grad_y.dtype)


# ---- vocabulary-parallel cross entropy, this rank's shard: logits [..., cols], target [...] (local indices) ----

def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor,
                        valid_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cols = logits.shape[-1]
    x = logits.float()
    x = x.masked_fill(torch.arange(cols, device=x.device) >= valid_cols, float("-inf"))
    row_max = x.max(dim=-1).values
    finite_max = torch.where(torch.isinf(row_max) & (row_max < 0), 0.0, row_max)   # no valid column: sum stays 0
    sum_exp = (x - finite_max.unsqueeze(-1)).exp().sum(dim=-1)
    here = (target >= 0) & (target < cols)
    target_logit = logits.float().gather(-1, target.clamp(0, cols - 1).unsqueeze(-1)).squeeze(-1)
    return row_max, sum_exp, torch.where(here, target_logit, 0.0)


def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, max: torch.Tensor, sum_exp: torch.Tensor,
                       grad_loss: torch.Tensor, valid_cols: int) -> torch.Tensor:
    cols = logits.shape[-1]
    probs = (logits.float() - max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    probs = probs.masked_fill(torch.arange(cols, device=logits.device) >= valid_cols, 0.0)
    one_hot = torch.nn.functional.one_hot(target.clamp(0, cols - 1), cols).to(probs.dtype)
    one_hot = one_hot * ((target >= 0) & (target < cols)).unsqueeze(-1)
    return ((probs - one_hot) * grad_loss.unsqueeze(-1)).to(logits.dtype)
