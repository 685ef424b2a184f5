"""Tensor parallelism: communication ops, parallel layers (with their FP8 products), vocab-parallel loss, dropout
RNG, sharding specs, sequence-parallel mappings, activation recompute and offloading, and deferred weight gradients."""

from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fp8 import Fp8Recipe
from megalite.tensor_parallel.fp8_linear import Fp8History, fp8_histories, update_delayed_scales
from megalite.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             mark_sequence_parallel)
from megalite.tensor_parallel.mappings import (all_gather_over, all_gather_tensor_parallel, copy_to_tensor_parallel,
                                               gather_from_tensor_parallel, reduce_from_tensor_parallel,
                                               reduce_scatter_to_sequence_parallel, scatter_to_tensor_parallel)
from megalite.tensor_parallel.partition import Partition, initialize_parameters, shard, unshard
from megalite.tensor_parallel.offload import ActivationOffloader, offloading
from megalite.tensor_parallel.random import TensorParallelRNG
from megalite.tensor_parallel.recompute import DiscardedOutput, recompute
from megalite.tensor_parallel.weight_grad import WeightGradStore, attach_weight_grad_store, weight_gradient

__all__ = [
    "ColumnParallelLinear", "Fp8Recipe", "Fp8History", "fp8_histories", "update_delayed_scales", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "mark_sequence_parallel", "copy_to_tensor_parallel", "reduce_from_tensor_parallel", "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel", "all_gather_tensor_parallel", "reduce_scatter_to_sequence_parallel",
    "all_gather_over", "Partition",
    "initialize_parameters",
    "shard", "unshard", "TensorParallelRNG", "recompute", "DiscardedOutput", "ActivationOffloader", "offloading", "WeightGradStore", "attach_weight_grad_store",
    "weight_gradient",
]
