"""Datasets and samplers: what the model reads, in a layout-independent order."""

from megalite.data.mock import MockGPTDataset
from megalite.data.sampler import micro_batch_indices

__all__ = ["MockGPTDataset", "micro_batch_indices"]
