"""Fused ops written in C++ and CUDA (sources in ``csrc/``, built by megalite.extensions); every one has a plain-torch
fallback. ``policy`` decides per op and tensor whether the fused CUDA kernels run (``--use-fused-kernels``);
``agreement.prepare`` builds and self-checks them once before training and agrees on the verdict over every rank;
``fused`` holds their autograd functions; ``torch_ops`` the kernels' functions in torch ops.
"""

from megalite.kernels.agreement import prepare
from megalite.kernels.policy import DEFAULT_POLICY, KernelPolicy, fused_extension

__all__ = ["KernelPolicy", "DEFAULT_POLICY", "fused_extension", "prepare"]
