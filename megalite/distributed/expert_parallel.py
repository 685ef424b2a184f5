"""Expert parallelism behind the engine contract: two engines, one for the dense parameters and one for the experts'.

A dense parameter is replicated over the DP x CP ranks, which see different tokens: its gradient is summed over
DP x CP. A routed expert's parameter (flagged ``is_expert``) lives only on the ranks of its expert-parallel rank,
and every token routed to it already reached it through the dispatcher's all-to-alls, whose backward brought the
gradient of every EP rank's tokens to it: what is left is the sum over the ranks holding the same experts, the
expert-data-parallel group (DP x CP / EP). So each kind gets its own engine over its own group, and the distributed
optimizer shards each over its own group too: a dense piece is 1/(DP x CP) of a bucket of dense parameters, an
expert piece 1/(DP x CP / EP) of a bucket of experts. :class:`EngineUnion` presents the two as one engine to the
optimizer, the trainer and checkpoints.
"""

from __future__ import annotations

import torch

from megalite.distributed.engine import DataParallelEngine, Piece


def is_expert(param: torch.nn.Parameter) -> bool:
    return getattr(param, "is_expert", False)


class EngineUnion(DataParallelEngine):
    """Several engines over disjoint parameters, run side by side."""

    def __init__(self, engines: list[DataParallelEngine]):
        self.engines = engines
        self.params = [p for engine in engines for p in engine.params]
        self.device = engines[0].device
        self.distributed = engines[0].distributed
        if any(engine.distributed != self.distributed for engine in engines):
            raise ValueError("the engines of a union must all shard their optimizer states, or none")
        self._owner = {id(p): engine for engine in engines for p in engine.params}

    def range(self, param: torch.nn.Parameter) -> tuple[int, int]:
        return self._owner[id(param)].range(param)

    def pieces(self) -> list[Piece]:
        return [piece for engine in self.engines for piece in engine.pieces()]

    def held_bytes(self) -> tuple[int, int]:
        held = [engine.held_bytes() for engine in self.engines]
        return sum(p for p, _ in held), sum(g for _, g in held)

    def start_iteration(self, num_micro_batches: int) -> None:
        for engine in self.engines:
            engine.start_iteration(num_micro_batches)

    def finish_grad_sync(self) -> None:
        for engine in self.engines:
            engine.finish_grad_sync()

    def zero_grad(self) -> None:
        for engine in self.engines:
            engine.zero_grad()

    def gather_params(self) -> None:
        for engine in self.engines:
            engine.gather_params()

    def finish_param_sync(self) -> None:
        for engine in self.engines:
            engine.finish_param_sync()
