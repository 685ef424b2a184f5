"""The GPT model, built from tensor-parallel layers; knows nothing of schedules or optimizers."""

from megalite.model.gpt import GPTModel

__all__ = ["GPTModel"]
