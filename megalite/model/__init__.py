"""The GPT model, built from tensor-parallel layers; knows nothing of schedules or optimizers."""

from megalite.model.gpt import GPTModel
from megalite.model.kv_cache import KVCache

__all__ = ["GPTModel", "KVCache"]
