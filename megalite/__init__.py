"""megalite: Megatron-style 3D-parallel GPT training on PyTorch, small enough to read."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: `import megalite` stays cheap, and megalite.config never pulls in torch models.
    if name == "load_pretrained":
        from megalite.checkpoint import load_pretrained
        return load_pretrained
    raise AttributeError(f"module 'megalite' has no attribute {name!r}")
