"""An uneven pipeline split that balances the stages' compute, for layer counts PP does not divide.

Each layer costs its forward multiply-adds per token (megalite.model.flops: MoE layers their active experts, so
DeepSeek-V3's dense first layers cost less); the last stage also runs the output layer (vocabulary x hidden), the first
only an embedding lookup. The split minimizes the slowest stage (binary search over the stage time, stages packed
from the back, each stage keeping at least one layer), which leaves any slack on the first stages: they hold the most
micro-batches in flight under 1F1B, so fewer layers there is also the memory-friendly choice (as Megatron's users give
--decoder-first-pipeline-num-layers).
"""

from __future__ import annotations

from megalite.config import ModelConfig
from megalite.model.flops import macs_per_token_per_layer


def _pack_from_back(costs: list[float], stages: int, head: float, limit: float) -> list[int] | None:
    """Layers per stage with every stage (the last with the ``head``) at most ``limit``, filled from the last stage
    backwards and leaving a layer for each earlier stage while there are enough; None when they do not fit."""
    split, end = [0] * stages, len(costs)
    for stage in reversed(range(stages)):
        budget = limit - (head if stage == stages - 1 else 0.0)
        while end > 0 and costs[end - 1] <= budget and (end > stage or len(costs) < stages):
            budget -= costs[end - 1]
            end -= 1
            split[stage] += 1
    return split if end == 0 else None


def balanced_split(costs: list[float], stages: int, head: float = 0.0) -> tuple[int, ...]:
    """Layers per stage (contiguous, in order) minimizing the slowest stage's cost."""
    low, high = max([head, *costs]), sum(costs) + head
    for _ in range(60):   # to well below one layer's cost
        middle = (low + high) / 2
        if _pack_from_back(costs, stages, head, middle) is None:
            low = middle
        else:
            high = middle
    return tuple(_pack_from_back(costs, stages, head, high))


def balanced_pipeline_split(model: ModelConfig, pp: int) -> tuple[int, ...]:
    """The split :func:`balanced_split` gives ``model`` over ``pp`` stages (one chunk per rank)."""
    costs = [float(macs_per_token_per_layer(model, i)) for i in range(model.num_layers)]
    return balanced_split(costs, pp, float(model.padded_vocab_size(1) * model.hidden_size))
