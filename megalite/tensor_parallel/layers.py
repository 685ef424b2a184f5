"""Tensor-parallel layers: Megatron's column/row-parallel linears and the vocab-parallel embedding.

A column-parallel linear keeps a block of output rows of the weight (Y_i = X A_i); a row-parallel linear keeps a block
of input columns (Y = sum_i X_i B_i, summed by an all-reduce). An MLP or attention block is column-parallel then
row-parallel, so the activation between them never leaves its rank.

With ``sequence_parallel`` the activations outside that pair are split along the sequence: a column-parallel linear
all-gathers its input (and reduce-scatters the input's gradient), a row-parallel linear and the embedding
reduce-scatter their output instead of all-reducing it. Replicated parameters applied to a sequence shard (the
row-parallel bias) are flagged ``sequence_parallel`` so their partial gradients are summed over TP.

Both linears compute their weight gradient with ``weight_gradient`` and can leave it to a later W step of a
zero-bubble pipeline schedule (``weight_grad_store``, see megalite.tensor_parallel.weight_grad); with gradient-
accumulation fusion it goes straight into their weight's main gradient.

Given an FP8 recipe (``fp8``), a linear computes its three products in FP8 (megalite.tensor_parallel.fp8_linear) on
the same bf16 weight and with the same communication around them; with the delayed recipe it keeps its amax
history in ``fp8_history``. Its weight gradient, an FP8 product too, can be deferred to a W step the same way
(the store keeps the quantized output gradient and input); it never fuses into the main gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state
from megalite.tensor_parallel.fp8 import Fp8Recipe
from megalite.tensor_parallel.fp8_linear import Fp8History, fp8_linear
from megalite.tensor_parallel.mappings import (SEQUENCE_DIM, all_gather, copy_to_tensor_parallel,
                                               gather_from_tensor_parallel, reduce_from_tensor_parallel,
                                               reduce_scatter, reduce_scatter_to_sequence_parallel,
                                               scatter_to_tensor_parallel)
from megalite.tensor_parallel.partition import REPLICATED, Partition, local_shape, mark, normal_init, zeros_init
from megalite.tensor_parallel.weight_grad import WeightGradStore, accumulates_into_main_grad, weight_gradient


def _parameter(full_shape: tuple[int, ...], partition: Partition, init_fn) -> nn.Parameter:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    param = nn.Parameter(torch.empty(local_shape(full_shape, partition, tp)))
    return mark(param, full_shape, partition, init_fn)


class _Linear(torch.autograd.Function):
    """y = x A^T + b under sequence parallelism's collectives, fused so that backward keeps shards only.

    ``gather_input`` (column-parallel): x is this rank's sequence shard, all-gathered here; only the shard is saved
    and backward gathers it again (Megatron's trade: one more all-gather instead of keeping TP times the input for
    the weight gradient), reduce-scattering the input's gradient. ``scatter_output`` (row-parallel): the partial
    product is reduce-scattered here; backward all-gathers the output gradient. The weight gradient is
    ``weight_gradient``'s, computed here or, inside a zero-bubble B step, deferred to ``store`` for the W step
    (megalite.tensor_parallel.weight_grad) with the shards only: the W step gathers them again."""

    @staticmethod
    def forward(ctx, x, weight, bias, gather_input: bool, scatter_output: bool, store: WeightGradStore | None):
        # The weight itself, not a saved tensor: under saved-tensor hooks (activation offloading) a saved tensor
        # comes back as a new tensor object, without the parameter's main-gradient accumulator (its gradient would
        # be lost) or identity. A leaf on ctx makes no reference cycle.
        ctx.save_for_backward(x)
        ctx.weight = weight
        ctx.has_bias, ctx.gather_input, ctx.scatter_output, ctx.store = (bias is not None, gather_input,
                                                                         scatter_output, store)
        y = F.linear(all_gather(x, SEQUENCE_DIM) if gather_input else x, weight, bias)
        return reduce_scatter(y, SEQUENCE_DIM) if scatter_output else y

    @staticmethod
    def backward(ctx, grad):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_output = all_gather(grad, SEQUENCE_DIM) if ctx.scatter_output else grad
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
            if ctx.gather_input:
                grad_input = reduce_scatter(grad_input, SEQUENCE_DIM)
        if ctx.needs_input_grad[1]:
            if ctx.store is not None and ctx.store.defers(weight):
                ctx.store.defer(weight, functools.partial(_weight_gradient, weight=weight), grad, x, ctx.gather_input,
                                ctx.scatter_output)
            else:   # None where it went straight into the weight's main gradient
                grad_weight = _weight_gradient(grad_output, x, ctx.gather_input, False, weight=weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None, None


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor, gather_input: bool, gather_grad: bool, *,
                     weight: torch.Tensor) -> torch.Tensor | None:
    return weight_gradient(all_gather(grad, SEQUENCE_DIM) if gather_grad else grad,
                           all_gather(x, SEQUENCE_DIM) if gather_input else x, weight)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradStore | None, *,
            gather_input: bool = False, scatter_output: bool = False) -> torch.Tensor:
    """Torch's own linear where nothing is gathered, scattered, deferred or accumulated into a main gradient (its
    backward runs in C++), else ``_Linear``."""
    if not gather_input and not scatter_output and store is None and not accumulates_into_main_grad(weight):
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, gather_input, scatter_output, store)


class _Fp8Products:
    """The FP8 side of a linear (``fp8``: its recipe or None; ``fp8_history``: its delayed amax history)."""

    def _init_fp8(self, fp8: Fp8Recipe | None) -> None:
        self.fp8 = fp8
        self.fp8_history = Fp8History(fp8) if fp8 is not None and fp8.recipe == "delayed" else None
        self.fp8_weight_cache = True   # the weight's FP8 copy kept for the step's micro-batches (off at ZeRO-3)

    def _fp8_product(self, x: torch.Tensor, weight: torch.Tensor, kind: str, gather_sequence: bool = False):
        return fp8_linear(x, weight, self.fp8, self.fp8_history, kind, gather_sequence,
                          record=self.training and torch.is_grad_enabled(), store=self.weight_grad_store,
                          cache_weight=self.fp8_weight_cache)


def mark_sequence_parallel(param: nn.Parameter | None) -> None:
    """Flag a TP-replicated parameter that acts on this rank's sequence shard (its gradient is summed over TP)."""
    if param is not None:
        param.sequence_parallel = True


class ColumnParallelLinear(_Fp8Products, nn.Module):
    """y = x A^T + b with A's output rows split over TP. ``fused`` (a number of equal blocks, or the block sizes)
    splits each stacked block separately (a fused QKV weight [q; k; v] gives each rank its heads' q, k and v; with
    grouped-query attention the blocks are unequal). ``padded_output_size`` zero-pads the rows first (the vocabulary
    of an output layer). With ``weight_from_caller`` the layer owns no weight and ``forward`` takes one (an output
    layer tied to the word embedding). With ``sequence_parallel`` the input is this rank's sequence shard, gathered
    here."""

    def __init__(self, input_size: int, output_size: int, *, init_std: float, bias: bool = True,
                 gather_output: bool = False, fused: int | tuple[int, ...] = 1,
                 padded_output_size: int | None = None, weight_from_caller: bool = False,
                 sequence_parallel: bool = False, fp8: Fp8Recipe | None = None):
        super().__init__()
        self._init_fp8(fp8)
        if gather_output and fused != 1:
            raise ValueError("a gathered output of a fused weight would interleave the blocks rank by rank")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        partition = Partition(dim=0, fused=fused, padded_size=padded_output_size)
        self.weight = (None if weight_from_caller
                       else _parameter((output_size, input_size), partition, normal_init(init_std)))
        self.bias = _parameter((output_size,), partition, zeros_init) if bias else None
        self.weight_grad_store: WeightGradStore | None = None   # see megalite.tensor_parallel.weight_grad

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                skip_bias_add: bool = False) -> torch.Tensor:
        """``skip_bias_add``: leave the bias out, for a caller that adds it fused with what follows (bias + GeLU)."""
        weight = self.weight if weight is None else weight
        bias = None if skip_bias_add else self.bias
        gather = self.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
        if self.fp8 is not None:
            y = self._fp8_product(x if gather else copy_to_tensor_parallel(x), weight, "column", gather)
            y = y + bias if bias is not None else y
        elif gather:
            y = _linear(x, weight, bias, self.weight_grad_store, gather_input=True)
        else:
            y = _linear(copy_to_tensor_parallel(x), weight, bias, self.weight_grad_store)
        return gather_from_tensor_parallel(y) if self.gather_output else y


class RowParallelLinear(_Fp8Products, nn.Module):
    """y = x B^T + b with B's input columns split over TP; partial products are summed by one all-reduce
    (a reduce-scatter along the sequence with ``sequence_parallel``). The bias is replicated and added once, after
    the sum."""

    def __init__(self, input_size: int, output_size: int, *, init_std: float, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, fp8: Fp8Recipe | None = None):
        super().__init__()
        self._init_fp8(fp8)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _parameter((output_size, input_size), Partition(dim=1), normal_init(init_std))
        self.bias = _parameter((output_size,), REPLICATED, zeros_init) if bias else None
        if sequence_parallel:
            mark_sequence_parallel(self.bias)
        self.weight_grad_store: WeightGradStore | None = None   # see megalite.tensor_parallel.weight_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if parallel_state.get_tensor_model_parallel_world_size() == 1:   # nothing to sum: the bias add fused in
            if self.fp8 is not None:
                y = self._fp8_product(x, self.weight, "row")
                return y + self.bias if self.bias is not None else y
            return _linear(x, self.weight, self.bias, self.weight_grad_store)
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x)
        if self.fp8 is not None:
            partial = self._fp8_product(x, self.weight, "row")
            y = (reduce_scatter_to_sequence_parallel(partial) if self.sequence_parallel
                 else reduce_from_tensor_parallel(partial))
        elif self.sequence_parallel:   # the sum reduce-scattered inside, so a deferred W keeps the gradient's shard
            y = _linear(x, self.weight, None, self.weight_grad_store, scatter_output=True)
        else:
            y = reduce_from_tensor_parallel(_linear(x, self.weight, None, self.weight_grad_store))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows. Each rank looks up the ids in its range, writes zeros for the others,
    and an all-reduce assembles the full embeddings. Rows past ``num_embeddings`` (vocabulary padding) start at zero
    and, never looked up, stay there. With ``sequence_parallel`` a reduce-scatter leaves each rank its sequence
    shard instead."""

    def __init__(self, num_embeddings: int, padded_num_embeddings: int, embedding_dim: int, *, init_std: float,
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        partition = Partition(dim=0, padded_size=padded_num_embeddings)
        self.weight = _parameter((num_embeddings, embedding_dim), partition, normal_init(init_std))
        per_rank = padded_num_embeddings // tp
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(embeddings)
        return reduce_from_tensor_parallel(embeddings)
