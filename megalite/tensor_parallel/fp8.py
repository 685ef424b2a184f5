"""FP8 numerics: the recipe, scaling, quantization and the scaled matrix product (Micikevicius et al. 2022,
"FP8 Formats for Deep Learning"; Transformer Engine's recipes), on torch alone.

A tensor is quantized as q = cast_fp8(clamp(x * s)), with s = fp8_max / amax / 2^margin, and a product of two
quantized operands is dequantized by their inverse scales: A B ~ (q_A / s_A)(q_B / s_B), which
``torch._scaled_mm`` computes in one kernel with FP32 accumulation (FP8 tensor cores on Hopper; it runs on CPU in
recent torch too). The formats: ``e4m3`` everywhere, or ``hybrid``, e4m3 forward and e5m2 (more range, less
precision) for gradients. What amax is, the recipe says:

- ``tensorwise``: the amax of the whole tensor now (current scaling);
- ``delayed``: one scale per tensor from the amax history of earlier steps (``max`` of the history or its
  ``most_recent`` entry; megalite.tensor_parallel.fp8_linear keeps the histories);
- ``rowwise``: one scale per row of activations and gradients and per column of weights: per index of each
  product's outer dimensions, the amax taken along its inner (contracted) one, so the scales factor out of the sum.

Where ``torch._scaled_mm`` cannot take a product (torch older than its CPU kernel, rowwise scales or an e5m2 pair a
GPU's kernel refuses, another signature) it is computed from the same quantized operands dequantized to fp32: the
same numbers, without the speed. :func:`backends` says which products took which path.

torchao.float8 has these pieces too, but as tensor subclasses for its own module swap and DTensor plans; megalite's
tensor-parallel layers call the three products themselves, so the few formulas are written here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "rowwise")
AMAX_ALGOS = ("max", "most_recent")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_EPS = 1e-12   # an all-zero tensor gets a large finite scale (its quantized values are zeros anyway)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """What ``--fp8-format`` and ``--fp8-recipe`` (with the delayed recipe's options) choose."""
    format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        for name, value, choices in [("format", self.format, FORMATS), ("recipe", self.recipe, RECIPES),
                                     ("amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS)]:
            if value not in choices:
                raise ValueError(f"FP8 {name} must be one of {', '.join(choices)}, got {value!r}")

    @classmethod
    def of(cls, model_cfg) -> Optional["Fp8Recipe"]:
        """The recipe of a ModelConfig, None without ``--fp8-format``."""
        if model_cfg.fp8_format is None:
            return None
        return cls(model_cfg.fp8_format, model_cfg.fp8_recipe, model_cfg.fp8_margin, model_cfg.fp8_amax_history_len,
                   model_cfg.fp8_amax_compute_algo)

    @property
    def forward_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3

    def describe(self) -> str:
        text = f"FP8 {self.format} {self.recipe}"
        if self.recipe == "delayed":
            text += f" (amax history {self.amax_history_len}, {self.amax_compute_algo})"
        return text + (f", margin {self.margin}" if self.margin else "")


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 in hardware (NVIDIA compute capability 8.9, Ada, and later: Hopper's
    H100/H200 twice their bf16 rate); elsewhere FP8 runs correctly but no faster than bf16."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def amax(x: torch.Tensor, inner_dim: Optional[int] = None) -> torch.Tensor:
    """max |x| in fp32: of the whole tensor, or along ``inner_dim`` (kept, size 1) for per-row/column scales."""
    magnitude = x.detach().abs()
    return (magnitude.amax() if inner_dim is None else magnitude.amax(dim=inner_dim, keepdim=True)).float()


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """s = fp8_max / amax / 2^margin (Transformer Engine's formula), so that amax lands 2^margin below fp8_max."""
    return torch.finfo(dtype).max / amax.float().clamp(min=AMAX_EPS) / 2.0 ** margin


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cast_fp8(clamp(x * scale)): values beyond the format's range saturate instead of becoming NaN/Inf."""
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


_backends: dict[tuple, str] = {}   # (device type, dtypes, scaling) -> "torch._scaled_mm" or "dequantized fp32"


def backends() -> dict[str, str]:
    """Which path each kind of product took so far in this process (for start-up lines and the GPU check)."""
    return {" ".join(str(k) for k in key): value for key, value in _backends.items()}


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inverse: torch.Tensor, b_inverse: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a / s_a) @ (b / s_b) for FP8 ``a`` [M, K] and ``b`` [K, N] with their inverse scales (0-dim, or [M, 1] and
    [1, N] for rowwise), in ``out_dtype``; FP32 accumulation either way."""
    rowwise = a_inverse.dim() > 0
    key = (a.device.type, str(a.dtype).removeprefix("torch."), str(b.dtype).removeprefix("torch."),
           "rowwise" if rowwise else "tensorwise")
    if _backends.get(key) != "dequantized fp32":
        # The kernel wants a row-major and b column-major (cuBLASLt's layout for FP8); scales in fp32.
        a_major, b_major = a.contiguous(), b.t().contiguous().t()
        try:
            out = torch._scaled_mm(a_major, b_major, scale_a=a_inverse.float().contiguous(),
                                   scale_b=b_inverse.float().contiguous(), out_dtype=out_dtype)
            _backends[key] = "torch._scaled_mm"
            return out[0] if isinstance(out, tuple) else out   # torch < 2.5 returned (out, amax)
        except (RuntimeError, TypeError, NotImplementedError, AttributeError):
            if _backends.get(key) == "torch._scaled_mm":
                raise   # it worked before for this kind: the failure is real, not a missing kernel
            _backends[key] = "dequantized fp32"
    return ((a.float() * a_inverse.float()) @ (b.float() * b_inverse.float())).to(out_dtype)


def quantized_matmul(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
                     recipe: str = "tensorwise", margin: int = 0,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """a @ b through FP8 with current scales (tensorwise, or rowwise along the inner dimension): quantize, scaled
    product, dequantize. The single-process form of what the linears do, for tests and the GPU check."""
    inner_a, inner_b = (1, 0) if recipe == "rowwise" else (None, None)
    scale_a = scale_from_amax(amax(a, inner_a), a_dtype, margin)
    scale_b = scale_from_amax(amax(b, inner_b), b_dtype, margin)
    return scaled_mm(quantize(a, scale_a, a_dtype), quantize(b, scale_b, b_dtype), scale_a.reciprocal(),
                     scale_b.reciprocal(), out_dtype or a.dtype)
