"""Gradient reductions over data-parallel replicas and over tied-embedding copies."""

from megalite.distributed.grad_sync import all_reduce_gradients, all_reduce_tied_embedding_gradients

__all__ = ["all_reduce_gradients", "all_reduce_tied_embedding_gradients"]
