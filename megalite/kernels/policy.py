"""Which ops run as fused CUDA kernels: ``--use-fused-kernels auto|on|off`` and the per-op off switches.

- ``auto`` (default): an op runs fused on CUDA tensors when the extension builds and its kernels pass their
  self-check on every rank; otherwise the model's plain torch ops run, everywhere, and rank 0 says why in one line.
  CPU tensors never trigger a build, so CPU runs are exactly the torch ops.
- ``on``: the same, but an extension that cannot be built, or a kernel that fails its self-check, is an error on the
  rank that finds it, before any collective; without a CUDA device ``on`` is already refused by
  ``megalite.config.validate``. ``on`` also swaps the attention core, see below.
- ``off``: torch ops everywhere.

The choice is made once, before training, by :func:`megalite.kernels.prepare` (:mod:`megalite.kernels.agreement`):
it builds the extension, self-checks its kernels (:mod:`megalite.kernels.self_check`) and agrees on the verdict over
every rank, then hands back the policy with the extension in it and the ops that failed anywhere switched off. A
policy that was not prepared runs torch ops: nothing is built inside a forward.

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

EXTENSION_NAME = "megalite_fused"
EXTENSION_SOURCES = ["fused_ops.cpp", "cuda/masked_softmax.cu", "cuda/bias_gelu.cu", "cuda/norms.cu",
                     "cuda/rotary.cu", "cuda/cross_entropy.cu"]

MASKED_SOFTMAX, BIAS_GELU, LAYERNORM, ROPE, CROSS_ENTROPY = (
    "masked_softmax", "bias_gelu", "layernorm", "rope", "cross_entropy")
OPS = (MASKED_SOFTMAX, BIAS_GELU, LAYERNORM, ROPE, CROSS_ENTROPY)
MODES = ("auto", "on", "off")


def fused_extension(required: bool = False, lock_timeout_s: float | None = None) -> types.ModuleType | None:
    """The CUDA extension (built on first call in a process), ``None`` where it cannot be had; with ``required``, an
    :class:`ExtensionUnavailable` saying why instead of ``None``. Building needs a CUDA build of torch and nvcc, not
    a GPU. ``lock_timeout_s``: how long another process's build may hold the build lock (megalite.extensions)."""
    return load_extension(EXTENSION_NAME, EXTENSION_SOURCES, required=required, lock_timeout_s=lock_timeout_s)


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    mode: str = "auto"
    disabled: frozenset[str] = frozenset()   # ops that always run as torch ops
    # The built and self-checked extension, set by megalite.kernels.prepare (which also adds the ops that failed on
    # any rank to ``disabled``); None, in a policy not prepared, means torch ops for every op.
    extension: types.ModuleType | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"use_fused_kernels must be one of {', '.join(MODES)}, got {self.mode!r}")
        unknown = set(self.disabled) - set(OPS)
        if unknown:
            raise ValueError(f"unknown fused ops {sorted(unknown)}; known: {', '.join(OPS)}")

    @classmethod
    def from_config(cls, cfg: KernelConfig) -> KernelPolicy:
        # --torch-compile: an extension call is opaque to the compiler (a graph break in every layer), and the
        # compiler fuses the torch ops of the layers' norms, bias + GeLU and rotary embeddings itself.
        compiled = cfg.torch_compile
        switches = {MASKED_SOFTMAX: cfg.no_masked_softmax_fusion or compiled,
                    BIAS_GELU: cfg.no_bias_gelu_fusion or compiled, LAYERNORM: cfg.no_layernorm_fusion or compiled,
                    ROPE: cfg.no_rope_fusion or compiled, CROSS_ENTROPY: cfg.no_cross_entropy_loss_fusion}
        return cls(cfg.use_fused_kernels, frozenset(op for op, off in switches.items() if off))

    def enabled(self, op: str) -> bool:
        """Whether ``op`` runs fused on CUDA tensors under this policy (once prepared with a working extension)."""
        if self.mode == "off" or op in self.disabled:
            return False
        return op != MASKED_SOFTMAX or self.mode == "on"   # auto: SDPA beats an unfused attention core

    def ops(self, op: str, x: torch.Tensor) -> types.ModuleType | None:
        """The extension if ``op`` on ``x`` runs fused, else ``None`` (run the torch ops)."""
        if self.extension is None or not x.is_cuda or not self.enabled(op):
            return None
        return self.extension


DEFAULT_POLICY = KernelPolicy()

__all__ = ["KernelPolicy", "DEFAULT_POLICY", "ExtensionUnavailable", "fused_extension", "OPS", "MODES"]
