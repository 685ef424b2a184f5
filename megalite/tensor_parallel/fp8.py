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
same numbers, without the speed, and a warning says so once per kind of product. :func:`backends` says which
products took which path. Off CPU (CUDA, and the ``meta`` device standing for it) the operands are checked against
the kernel's layout contract first (:func:`check_scaled_mm_operands`): a breach is megalite's bug, raised, not a
reason to fall back.

torchao.float8 has these pieces too, but as tensor subclasses for its own module swap and DTensor plans; megalite's
tensor-parallel layers call the three products themselves, so the few formulas are written here.
"""

from __future__ import annotations

import dataclasses
import warnings
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
    """max |x| in fp32: of the whole tensor, or along ``inner_dim`` (kept, size 1) for per-row/column scales. The
    whole tensor's is max(max x, -min x) from one aminmax pass without an |x| temporary (exact, and on CPU ten
    times faster than abs().amax(), which per row or column is as fast as aminmax or faster)."""
    x = x.detach()
    if inner_dim is None:
        low, high = torch.aminmax(x)
        return torch.maximum(high, -low).float()
    return x.abs().amax(dim=inner_dim, keepdim=True).float()


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """s = fp8_max / amax / 2^margin (Transformer Engine's formula), so that amax lands 2^margin below fp8_max."""
    return torch.finfo(dtype).max / amax.float().clamp(min=AMAX_EPS) / 2.0 ** margin


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cast_fp8(clamp(x * scale)): values beyond the format's range saturate instead of becoming NaN/Inf. One fp32
    copy of x, scaled and clamped in place, then cast (the arithmetic of fp32(x) * scale, bit for bit): one fp32
    temporary instead of three. (Multiplying bf16 x by a 1-element fp32 scale promotes to fp32 without the copy, a
    pass fewer on a GPU, but on CPU torch makes that copy itself, slower.)"""
    limit = torch.finfo(dtype).max
    return x.to(torch.float32, copy=True).mul_(scale).clamp_(-limit, limit).to(dtype)


KERNEL, FALLBACK = "torch._scaled_mm", "dequantized fp32"
_backends: dict[tuple, str] = {}   # (device type, dtypes, scaling) -> KERNEL or FALLBACK


def backends() -> dict[str, str]:
    """Which path each kind of product took so far in this process (for start-up lines and the GPU check)."""
    return {" ".join(str(k) for k in key): value for key, value in _backends.items()}


def _is_row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) > 1 or 0 in t.shape


def _is_column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) > 1 or 0 in t.shape


def check_scaled_mm_operands(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                             out_dtype: torch.dtype) -> None:
    """Raise ValueError naming the first of ``torch._scaled_mm``'s CUDA contracts that ``a`` [M, K] @ ``b`` [K, N]
    breaks: CPU's kernel takes any layout, so the tests pass there what a GPU would refuse. ``a`` row-major, ``b``
    column-major (``b.t()`` contiguous: cuBLASLt's FP8 layout), K and N multiples of 16 (M is free), fp32 scales
    of one element each (tensorwise) or contiguous [M, 1] and [1, N] (rowwise), output bf16 or fp32."""
    def breach(text):
        raise ValueError(f"torch._scaled_mm contract broken: {text} (a {tuple(a.shape)} strides {a.stride()}, "
                         f"b {tuple(b.shape)} strides {b.stride()})")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        breach("the operands must be 2-D matrices [M, K] and [K, N]")
    if not _is_row_major(a):
        breach("the first operand must be row-major (contiguous)")
    if not _is_column_major(b):
        breach("the second operand must be column-major (its transpose contiguous)")
    (m, k), n = a.shape, b.shape[1]
    if k % 16 or n % 16:
        breach(f"the inner dimension K={k} and the output columns N={n} must be multiples of 16")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        breach(f"the scales must be fp32, got {scale_a.dtype} and {scale_b.dtype}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = (tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n) and scale_a.is_contiguous()
               and scale_b.is_contiguous())
    if not (tensorwise or rowwise):
        breach(f"the scales must have one element each (tensorwise) or be contiguous [M, 1] and [1, N] (rowwise), "
               f"got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        breach(f"the output must be bf16 or fp32, got {out_dtype}")


def _kernel_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` row-major and ``b`` column-major, as the kernel wants them (copies only where they are not)."""
    return a.contiguous(), b.t().contiguous().t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inverse: torch.Tensor, b_inverse: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a / s_a) @ (b / s_b) for FP8 ``a`` [M, K] and ``b`` [K, N] with their inverse scales (0-dim, or [M, 1] and
    [1, N] for rowwise), in ``out_dtype``; FP32 accumulation either way."""
    rowwise = a_inverse.dim() > 0
    key = (a.device.type, str(a.dtype).removeprefix("torch."), str(b.dtype).removeprefix("torch."),
           "rowwise" if rowwise else "tensorwise")
    if _backends.get(key) != FALLBACK:
        a_major, b_major = _kernel_layout(a, b)
        scale_a, scale_b = a_inverse.float().contiguous(), b_inverse.float().contiguous()
        if a.device.type != "cpu":
            check_scaled_mm_operands(a_major, b_major, scale_a, scale_b, out_dtype)
        try:
            out = torch._scaled_mm(a_major, b_major, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
            _backends[key] = KERNEL
            return out[0] if isinstance(out, tuple) else out   # torch < 2.5 returned (out, amax)
        except (RuntimeError, TypeError, NotImplementedError, AttributeError) as error:
            if _backends.get(key) == KERNEL:
                raise   # it worked before for this kind: the failure is real, not a missing kernel
            _backends[key] = FALLBACK
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            warnings.warn(f"megalite: torch._scaled_mm refused FP8 products {' '.join(key)} ({reason}); these run "
                          f"from now on as fp32 products of the dequantized operands: the same numbers, without "
                          f"FP8's speed", RuntimeWarning, stacklevel=2)
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
