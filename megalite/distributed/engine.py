"""The contract between a data-parallel engine and its users (the optimizer, the trainer, checkpoints).

Two engines implement it: :class:`~megalite.distributed.data_parallel.DataParallel` (flat buckets, plain DP and
ZeRO-1/2) and :class:`~megalite.distributed.fully_sharded.FullyShardedDataParallel` (ZeRO-3 on FSDP2). One step, as
the trainer drives it: ``start_iteration`` -> forward/backward over the micro-batches -> ``finish_grad_sync`` (every
gradient summed over DP) -> the optimizer steps its ``pieces`` and calls ``gather_params`` -> ``zero_grad``.
``finish_param_sync`` before anything reads whole parameters (evaluation, checkpoints, the end of training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Piece:
    """The part of one parameter whose update this rank owns: elements [start, end) of the parameter's flat range
    in the engine (``engine.range(param)`` gives the parameter's own [first, last)), the model's storage of them,
    and their summed fp32 gradient, both 1-D views."""
    param: torch.nn.Parameter
    start: int
    end: int
    model_view: torch.Tensor
    grad: torch.Tensor


class DataParallelEngine(Protocol):
    params: list[torch.nn.Parameter]   # this rank's trainable parameters, in model order
    device: torch.device
    distributed: bool   # the ranks' pieces are disjoint over DP (with HSDP over one instance), so sums over them
    #                     (the gradient norm) run over it

    def range(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """The parameter's [first, last) in the coordinates of its pieces' start and end."""

    def pieces(self) -> list[Piece]:
        """What this rank updates of each parameter (a parameter it owns nothing of gives no piece)."""

    def held_bytes(self) -> tuple[int, int]:
        """(parameter, gradient) bytes this rank holds."""

    def start_iteration(self, num_micro_batches: int) -> None:
        """A global batch of ``num_micro_batches`` backward passes begins."""

    def finish_grad_sync(self) -> None:
        """After the last backward: every piece's gradient is summed over DP, and the model-parallel sums are done
        (the tied embedding's copies, the sequence-parallel parts: megalite.distributed.finalize)."""

    def zero_grad(self) -> None:
        """Start the next step's gradients."""

    def gather_params(self) -> None:
        """After the optimizer step: bring the updated pieces into the whole parameters (possibly asynchronously)."""

    def finish_param_sync(self) -> None:
        """Wait for any parameter gather still in flight and leave the parameters readable."""
