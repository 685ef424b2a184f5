"""The device's numerics settings: TF32 for fp32 products on CUDA only."""

from __future__ import annotations

import torch

from megalite.training.initialize import allow_tf32


def test_tf32_is_allowed_on_cuda_only():
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert not allow_tf32(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert allow_tf32(torch.device("cuda", 0))   # a device object needs no GPU
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
