"""Data-parallel gradient reduction."""

from megalite.distributed.data_parallel import all_reduce_gradients

__all__ = ["all_reduce_gradients"]
