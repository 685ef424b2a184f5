"""The float64 reference of FP8 products: quantize -> matrix product -> dequantize, from the formulas alone
(Transformer Engine's scale fp8_max / amax / 2^margin, saturating casts), shared by the in-process and TP tests."""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": (E4M3, E4M3), "hybrid": (E4M3, E5M2)}   # (forward, gradient) dtypes


def reference_dequantized(t: torch.Tensor, dtype: torch.dtype, inner_dim=None, amax=None, margin=0):
    """t quantized to ``dtype`` and back to float64: per tensor, or per index along the other dims of a 2-D t
    (``inner_dim``: the dimension each amax is taken along); ``amax`` overrides the tensor's own (delayed). The
    scale and t x scale are fp32 as in Transformer Engine (in float64 a rare product rounds to the neighbouring FP8
    value); the dequantization and the products are float64."""
    t = t.detach().float()
    if amax is None:
        amax = t.abs().max() if inner_dim is None else t.abs().amax(dim=inner_dim, keepdim=True)
    scale = torch.finfo(dtype).max / torch.as_tensor(amax, dtype=torch.float32).clamp(min=1e-12) / 2.0 ** margin
    limit = torch.finfo(dtype).max
    return (t * scale).clamp(-limit, limit).to(dtype).double() / scale.double()


def reference(x, w, g, recipe: str, fmt: str, amaxes=None, margin=0):
    """(y, dx, dW) in float64 for y = x W^T, from the quantized operands of each product."""
    fwd, bwd = FORMATS[fmt]
    a_x, a_w, a_g = amaxes or (None, None, None)
    if recipe == "rowwise":
        y = reference_dequantized(x, fwd, 1) @ reference_dequantized(w, fwd, 1).t()
        dx = reference_dequantized(g, bwd, 1) @ reference_dequantized(w, fwd, 0)
        dw = reference_dequantized(g.t(), bwd, 1) @ reference_dequantized(x, fwd, 0)
        return y, dx, dw
    xq, wq = reference_dequantized(x, fwd, amax=a_x, margin=margin), reference_dequantized(w, fwd, amax=a_w, margin=margin)
    gq = reference_dequantized(g, bwd, amax=a_g, margin=margin)
    return xq @ wq.t(), gq @ wq, gq.t() @ xq
