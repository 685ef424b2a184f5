"""Tensor parallelism: communication ops, parallel layers, vocab-parallel loss, dropout RNG, sharding specs."""

from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megalite.tensor_parallel.mappings import (copy_to_tensor_parallel, gather_from_tensor_parallel,
                                               reduce_from_tensor_parallel, scatter_to_tensor_parallel)
from megalite.tensor_parallel.partition import Partition, initialize_parameters, shard, unshard
from megalite.tensor_parallel.random import TensorParallelRNG

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "copy_to_tensor_parallel", "reduce_from_tensor_parallel", "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel", "Partition", "initialize_parameters", "shard", "unshard", "TensorParallelRNG",
]
