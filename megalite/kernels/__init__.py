"""Fused ops written in C++ (sources in ``csrc/``), built on first use; every one has a plain-torch fallback."""

from megalite.kernels.build import load_extension

__all__ = ["load_extension"]
