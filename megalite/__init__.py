"""megalite: Megatron-style 3D-parallel GPT training on PyTorch, small enough to read."""

__version__ = "0.1.0"
