"""A rank's routed experts: MLPs of ``--moe-ffn-hidden-size``, applied to the tokens sorted by expert.

With expert parallelism a rank holds E / EP consecutive experts; each is its own module, named by its *global*
index (``layers.3.mlp.experts.5.linear_fc1.weight`` on whichever rank holds expert 5), so names, initial values and
checkpoints are the same whatever EP is, and a checkpoint reshards across EP like across TP: by name.

An expert is the dense MLP's maths (GeLU, or a gated unit with fc1 = [gate; up]: SwiGLU, or gpt-oss' clamped quick
GeGLU with its offset) without the tensor-parallel linears:
split over TP (``--expert-tensor-parallel-size`` = TP) its fc1 keeps a block of output rows and fc2 a block of
input columns, exactly as ColumnParallelLinear/RowParallelLinear cut them, and the partial outputs are summed over
TP once for all experts (and the input gradients once in backward); with expert tensor-parallel size 1 every TP rank
holds whole experts. fc2's bias is added after that sum.

The input is every token this rank's experts received, sorted by expert, with ``counts[i]`` for the i-th local
expert. ``grouped`` runs each layer of all the experts as one ``torch._grouped_mm`` where this torch and device offer
it for the dtype and shapes, else a loop over experts (the same products). The grouped product reads each kind of
weight of all the experts as one [E, out, in] tensor: the experts' weights of a kind lie one after another in memory
(laid out so here, after every move of the module, and by the data-parallel buffer, which keeps each
:meth:`LocalExperts.stacked_parameters` group together), so that tensor is a view, not a copy per call; where they do
not (FSDP2's gathered parameters), they are stacked, with the same numbers.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.model.mlp import gated_activation
from megalite.tensor_parallel import (ActivationOffloader, DiscardedOutput, copy_to_tensor_parallel, offloading,
                                      reduce_from_tensor_parallel)
from megalite.tensor_parallel.partition import REPLICATED, Partition, local_shape, mark, normal_init, zeros_init


def _parameter(full_shape: tuple[int, ...], partition: Partition, init_fn, world: int) -> nn.Parameter:
    param = mark(nn.Parameter(torch.empty(local_shape(full_shape, partition, world))), full_shape, partition, init_fn)
    param.is_expert = True   # its gradient is summed over the expert-data-parallel group, not DP x CP
    return param


class ExpertLinear(nn.Module):
    def __init__(self, full_shape: tuple[int, int], partition: Partition, bias_partition: Partition | None,
                 init_std: float, world: int):
        super().__init__()
        self.weight = _parameter(full_shape, partition, normal_init(init_std), world)
        self.bias = (None if bias_partition is None else
                     _parameter((full_shape[0],), bias_partition, zeros_init, world))


class ExpertMLP(nn.Module):
    """One expert's weights (its computation is :class:`LocalExperts`', for all experts at once)."""

    def __init__(self, cfg: ModelConfig, split: bool, world: int):
        super().__init__()
        h, f = cfg.hidden_size, cfg.expert_ffn_size
        fc1 = 2 * f if cfg.gated_mlp else f
        bias = not cfg.disable_bias_linear
        rows = Partition(dim=0, fused=2 if cfg.gated_mlp else 1) if split else REPLICATED
        self.linear_fc1 = ExpertLinear((fc1, h), rows, rows if bias else None, cfg.init_method_std, world)
        self.linear_fc2 = ExpertLinear((h, f), Partition(dim=1) if split else REPLICATED, REPLICATED if bias else None,
                                       cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers), world)


def grouped_mm_available(x: torch.Tensor, widths: list[int]) -> bool:
    """Whether torch._grouped_mm runs here for these operands: this torch has it, the device and dtype are ones it
    supports (any on the CPU; bf16 on CUDA from compute capability 9.0), and every row (of ``widths`` elements) is a
    multiple of 16 bytes, which it requires."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu":
        return False
    return all(w * x.element_size() % 16 == 0 for w in widths)


class LocalExperts(nn.ModuleDict):
    """This expert-parallel rank's experts, keyed by global index."""
    offloader: Optional[ActivationOffloader] = None   # --offload-modules expert_fc1, moe_act: set by GPTModel

    def __init__(self, cfg: ModelConfig):
        ep = parallel_state.get_expert_model_parallel_world_size()
        per_rank = cfg.num_experts // ep
        first = parallel_state.get_expert_model_parallel_rank() * per_rank
        world = parallel_state.get_expert_tensor_parallel_world_size()
        split = world > 1
        super().__init__({str(first + i): ExpertMLP(cfg, split, world) for i in range(per_rank)})
        self.first, self.grouped, self.split = first, cfg.moe_grouped_gemm, split
        self.glu = gated_activation(cfg) if cfg.gated_mlp else None
        self.recompute_activation = "moe_act" in cfg.recomputed_modules()   # --recompute-modules moe_act
        self._lay_out_stacked()

    def stacked_parameters(self) -> list[list[nn.Parameter]]:
        """The parameters the grouped product reads as one tensor each, in expert order: each linear's weights, and
        its biases (the bias rows), of all the experts. The data-parallel buffer keeps each group together."""
        linears = [[e.linear_fc1 for e in self.values()], [e.linear_fc2 for e in self.values()]]
        groups = [[linear.weight for linear in kind] for kind in linears]
        return groups + [[linear.bias for linear in kind] for kind in linears if kind[0].bias is not None]

    def _lay_out_stacked(self) -> None:
        """Each group of :meth:`stacked_parameters` made views of one stacked tensor (same values), unless it lies
        so already (a move that changed nothing; the data-parallel buffer's layout, which must stay)."""
        for group in self.stacked_parameters():
            if _laid_out_stacked(group):
                continue
            stacked = torch.stack([p.detach() for p in group])
            for param, row in zip(group, stacked):
                param.data = row

    def _apply(self, fn, recurse=True):
        """A move or cast gives every parameter storage of its own: lay the groups out stacked again."""
        super()._apply(fn, recurse)
        self._lay_out_stacked()
        return self

    def forward(self, tokens: torch.Tensor, counts: list[int], device_counts: torch.Tensor) -> torch.Tensor:
        """Each expert applied to its rows of ``tokens`` [N, hidden] (``counts`` rows each, in order; the same
        counts on the device as ``device_counts``, so that the grouped product's offsets and the bias rows need no
        copy from the host)."""
        experts = list(self.values())
        if self.split:   # TP-split experts: the input gradient is summed over TP, the outputs in forward
            tokens = copy_to_tensor_parallel(tokens)
        fc1 = [e.linear_fc1 for e in experts]
        fc2 = [e.linear_fc2 for e in experts]
        widths = [tokens.shape[-1], fc1[0].weight.shape[0], fc2[0].weight.shape[1]]
        if self.grouped and grouped_mm_available(tokens, widths):
            offsets = device_counts.cumsum(0).to(torch.int32)
            with offloading(self.offloader, "expert_fc1", self.training):
                hidden = _grouped_linear(tokens, fc1, device_counts, offsets)
            out = self._activated(hidden, lambda hidden: _grouped_linear(hidden, fc2, device_counts, offsets,
                                                                         with_bias=False))
        else:
            with offloading(self.offloader, "expert_fc1", self.training):
                hidden = [F.linear(x, a.weight, a.bias) for x, a in zip(tokens.split(counts), fc1)]
            outs = [self._activated(y, lambda hidden, b=b: F.linear(hidden, b.weight)) for y, b in zip(hidden, fc2)]
            out = torch.cat(outs) if outs else tokens[:0]
        if self.split:
            out = reduce_from_tensor_parallel(out)
        if fc2[0].bias is not None:
            out = out + _bias_rows(fc2, device_counts, tokens.shape[0])
        return out

    def _activated(self, y: torch.Tensor, second_linear) -> torch.Tensor:
        """``second_linear(activation(y))``; with --recompute-modules moe_act the activation's output is freed once
        the second linear has run and recomputed from ``y`` when backward reaches the linear's output."""
        if not (self.recompute_activation and self.training and torch.is_grad_enabled()):
            with offloading(self.offloader, "moe_act", self.training):   # --offload-modules moe_act
                activated = self._activation(y)
            return second_linear(activated)
        activation = DiscardedOutput(self._activation, None)
        with offloading(self.offloader, "moe_act", self.training):   # what the rerun needs: y
            activated = activation.run(y)
        out = second_linear(activated)
        activation.discard(out)
        return out

    def _activation(self, y: torch.Tensor) -> torch.Tensor:
        return F.gelu(y) if self.glu is None else self.glu(y)


def _laid_out_stacked(tensors) -> bool:
    """Whether ``tensors`` of one shape lie one after another in one storage, as the rows of a stacked tensor."""
    first, size = tensors[0], tensors[0].numel()
    return all(t.shape == first.shape and t.dtype == first.dtype and t.is_contiguous()
               and t.storage_offset() == first.storage_offset() + i * size
               and torch._C._is_alias_of(t, first)   # one storage (asked of meta and fake tensors too)
               for i, t in enumerate(tensors))


class _Stacked(torch.autograd.Function):
    """Tensors of one shape as one [n, ...] tensor, as torch.stack (each gets its slice of the gradient back), but a
    view, without a copy, where they lie one after another in one storage."""

    @staticmethod
    def forward(ctx, *tensors):
        if _laid_out_stacked(tensors):
            first = tensors[0]
            return first.as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()),
                                    first.storage_offset())
        return torch.stack(tensors)

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, a view where they are laid out stacked (see :class:`_Stacked`)."""
    return _Stacked.apply(*tensors)


def _bias_rows(linears: list[ExpertLinear], counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Each expert's bias repeated for its rows: [rows, out] (``rows`` given: else the host waits to learn it)."""
    return stacked([linear.bias for linear in linears]).repeat_interleave(counts, dim=0, output_size=rows)


def _grouped_linear(x: torch.Tensor, linears: list[ExpertLinear], counts: torch.Tensor, offsets: torch.Tensor,
                    with_bias: bool = True) -> torch.Tensor:
    """Rows of ``x`` times each expert's weight^T in one grouped product (weights stacked [E, out, in])."""
    weights = stacked([linear.weight for linear in linears])
    y = torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets)
    if with_bias and linears[0].bias is not None:
        y = y + _bias_rows(linears, counts, x.shape[0])
    return y
