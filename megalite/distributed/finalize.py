"""The model-parallel gradient fix-ups, written once for both data-parallel engines (megatron/core's
``distributed/finalize_model_grads.py``).

Two kinds of parameter hold only part of their gradient on a rank, whatever the engine:

- the tied word embedding: the first pipeline stage's input embedding and the last stage's output layer are copies
  of one weight, each with the gradient of its own use. The copies' gradients are summed: here, when this rank holds
  both (the v-shape placement puts the first and the last stage on one rank), and over the embedding group (the
  first and the last stage, two ranks) otherwise.
- sequence-parallel parameters (replicated over TP, applied to this rank's sequence shard: norms, row-parallel
  biases, positions): their gradients are summed over TP.

Each engine's ``finish_grad_sync`` is :func:`finalize_model_grads` around its own data-parallel reduction, which
fixes the order, and with it the rounding: the tied sum before the DP reduction, the sequence-parallel sum after.
The tied copies' gradients are read before it in what the engine holds then (``tied_gradients``): the bucketed
engine's whole gradients, whose bucket waits for the sum (a distributed optimizer's shards of the two copies lie on
different DP ranks, so they could not be summed after); FSDP2's shards, already reduce-scattered during backward,
which the ranks of the embedding group cut alike. The sequence-parallel sum reads the reduced gradients through the
engine's pieces, which the TP ranks of one DP rank hold alike (their layouts are the same), so one all-reduce of
the pieces packed together sums them.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from megalite.distributed.engine import Piece
from megalite.parallel_state import GroupInfo


class ModelGradients(Protocol):
    """What :func:`finalize_model_grads` reads of a data-parallel engine (both engines are one)."""
    params: list[torch.nn.Parameter]
    device: torch.device   # the compute device: the groups' collectives run there
    tied_params: list[torch.nn.Parameter]   # this rank's copies of the tied word embedding (none, one or two)
    embedding_group: Optional[GroupInfo]   # the other stage's copy (None: there is none)
    tensor_group: Optional[GroupInfo]   # over which sequence-parallel gradients are summed (None: no TP)

    def tied_gradients(self) -> list[torch.Tensor]:
        """The gradient of each tied copy before the DP reduction completes (1-D, cut alike on the embedding
        group's ranks), with every copy's gradient of this step in it."""

    def reduce_data_parallel(self) -> None:
        """Sum every gradient over DP (what is left of it after backward) and wait for it."""

    def pieces(self) -> list[Piece]:
        """This rank's pieces of the gradients, once reduced over DP."""


def finalize_model_grads(engine: ModelGradients) -> None:
    """The tied embedding's copies summed, the data-parallel reduction, the sequence-parallel parameters' gradients
    summed over TP: every gradient whole in the engine's pieces."""
    _sum_tied_copies(engine)
    engine.reduce_data_parallel()
    _sum_sequence_parallel_parts(engine)


def all_reduce_packed(tensors: list[torch.Tensor], group: GroupInfo, device: torch.device) -> None:
    """Sum the 1-D ``tensors`` over ``group`` in place, with one all-reduce of them packed together on ``device``
    (the compute device: CPU-offloaded shards move there, as an NCCL group carries CUDA tensors only)."""
    if not tensors or group.size == 1:
        return
    packed = group.sum(torch.cat(tensors).to(device))
    torch._foreach_copy_(tensors, list(packed.split([t.numel() for t in tensors])))


def _sum_tied_copies(engine: ModelGradients) -> None:
    group = engine.embedding_group
    across = group is not None and group.size > 1
    if not across and len(engine.tied_params) < 2:
        return
    grads = engine.tied_gradients()
    if len(grads) > 1:
        total = torch.stack(grads).sum(dim=0)
        for grad in grads:
            grad.copy_(total)
    if across:   # two ranks, so the packed sum rounds as one all-reduce per copy would: a + b either way
        all_reduce_packed(grads, group, engine.device)


def _sum_sequence_parallel_parts(engine: ModelGradients) -> None:
    if engine.tensor_group is None or not any(_sequence_parallel(p) for p in engine.params):
        return
    all_reduce_packed([piece.grad for piece in engine.pieces() if _sequence_parallel(piece.param)],
                      engine.tensor_group, engine.device)


def _sequence_parallel(param: torch.nn.Parameter) -> bool:
    return getattr(param, "sequence_parallel", False)
