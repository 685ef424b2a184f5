"""Which ops run as fused CUDA kernels: ``--use-fused-kernels auto|on|off`` and the per-op off switches.

- ``auto`` (default): an op runs fused when its input is a CUDA tensor and the extension builds here (built on first
  use, cached: see :mod:`megalite.extensions`); otherwise the model's plain torch ops run, with one warning if a
  build was tried and failed. CPU tensors never trigger a build, so CPU runs are exactly the torch ops.
- ``on``: the same, but an extension that cannot be built is an error (with the compiler's or the lock's message),
  raised when the model is built; without a CUDA device ``on`` is already refused by ``megalite.config.validate``.
  ``on`` also swaps the attention core, see below.
- ``off``: torch ops everywhere.

Before the extension's kernels run on a device they check themselves against their torch specification
(:mod:`megalite.kernels.self_check`): an op that fails runs as torch ops with one warning (``auto``) or stops the
run (``on``).

The attention core is the one op where a torch op beats the kernel: ``F.scaled_dot_product_attention`` (flash or
memory-efficient attention) never writes the seq x seq scores that a fused softmax between two matmuls reads and
writes. So ``auto`` keeps it, and the masked-softmax kernel (Megatron's fused scaled upper-triangular softmax) runs
only with ``on``; ``--no-masked-softmax-fusion`` keeps SDPA even then. Apex and Transformer Engine are not used:
``tools/gpu_check.py`` times their LayerNorm/RMSNorm next to ours when they are importable, and none is wired in
until a measurement shows it faster.

The policy is a small immutable object handed to the model like its RNG tracker (no global state); each fused call
site asks ``policy.ops(op, x)`` for the ops to run, ``None`` meaning "your torch ops".
"""

from __future__ import annotations

import dataclasses
import types

import torch

from megalite.config import KernelConfig
from megalite.extensions import ExtensionUnavailable, load_extension
from megalite.kernels import self_check

EXTENSION_NAME = "megalite_fused"
EXTENSION_SOURCES = ["fused_ops.cpp", "cuda/masked_softmax.cu", "cuda/bias_gelu.cu", "cuda/norms.cu",
                     "cuda/rotary.cu", "cuda/cross_entropy.cu"]

MASKED_SOFTMAX, BIAS_GELU, LAYERNORM, ROPE, CROSS_ENTROPY = (
    "masked_softmax", "bias_gelu", "layernorm", "rope", "cross_entropy")
OPS = (MASKED_SOFTMAX, BIAS_GELU, LAYERNORM, ROPE, CROSS_ENTROPY)
MODES = ("auto", "on", "off")


def fused_extension(required: bool = False) -> types.ModuleType | None:
    """The CUDA extension (built on first call in a process), ``None`` where it cannot be had; with ``required``, an
    :class:`ExtensionUnavailable` saying why instead of ``None``. Building needs a CUDA build of torch and nvcc, not
    a GPU."""
    return load_extension(EXTENSION_NAME, EXTENSION_SOURCES, required=required)


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    mode: str = "auto"
    disabled: frozenset[str] = frozenset()   # ops that always run as torch ops

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"use_fused_kernels must be one of {', '.join(MODES)}, got {self.mode!r}")
        unknown = set(self.disabled) - set(OPS)
        if unknown:
            raise ValueError(f"unknown fused ops {sorted(unknown)}; known: {', '.join(OPS)}")

    @classmethod
    def from_config(cls, cfg: KernelConfig) -> KernelPolicy:
        switches = {MASKED_SOFTMAX: cfg.no_masked_softmax_fusion, BIAS_GELU: cfg.no_bias_gelu_fusion,
                    LAYERNORM: cfg.no_layernorm_fusion, ROPE: cfg.no_rope_fusion,
                    CROSS_ENTROPY: cfg.no_cross_entropy_loss_fusion}
        return cls(cfg.use_fused_kernels, frozenset(op for op, off in switches.items() if off))

    def enabled(self, op: str) -> bool:
        """Whether ``op`` runs fused on CUDA tensors under this policy (if the extension builds)."""
        if self.mode == "off" or op in self.disabled:
            return False
        return op != MASKED_SOFTMAX or self.mode == "on"   # auto: SDPA beats an unfused attention core

    def ops(self, op: str, x: torch.Tensor) -> types.ModuleType | None:
        """The extension if ``op`` on ``x`` runs fused, else ``None`` (run the torch ops): never for an op whose
        kernels failed their self-check on ``x``'s device (a warning under ``auto``, an error under ``on``)."""
        if not x.is_cuda or not self.enabled(op):
            return None
        extension = fused_extension(required=self.mode == "on")
        if extension is None:
            return None
        failures = self_check.failed_ops(extension, x.device, EXTENSION_NAME, EXTENSION_SOURCES)
        if op not in failures:
            return extension
        if self.mode == "on":
            raise self_check.refuse({op: failures[op]}, x.device)
        self_check.warn_once(op, failures[op], x.device)
        return None

    def check(self, device: torch.device | None = None) -> None:
        """With ``on``, build (or load) the extension and self-check its kernels on ``device`` (default: the current
        CUDA device) now, so that a failure stops the run at start-up on every rank alike, before any collective,
        rather than inside the first forward."""
        enabled = [op for op in OPS if self.enabled(op)]
        if self.mode != "on" or not enabled:
            return
        extension = fused_extension(required=True)
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        if device is not None:
            failures = self_check.failed_ops(extension, device, EXTENSION_NAME, EXTENSION_SOURCES)
            if any(op in failures for op in enabled):
                raise self_check.refuse({op: why for op, why in failures.items() if op in enabled}, device)


DEFAULT_POLICY = KernelPolicy()

__all__ = ["KernelPolicy", "DEFAULT_POLICY", "ExtensionUnavailable", "fused_extension", "OPS", "MODES"]
