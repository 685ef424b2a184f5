"""Forward/backward schedules over the micro-batches of one global batch.

A schedule takes a ``forward_step(micro_batch) -> (loss_to_backprop, report)`` callable and knows nothing of GPT. The
pipelined schedules (1F1B, interleaved) are the [pipeline] issue's; without pipelining, a schedule is gradient
accumulation: forward and backward each micro-batch in turn.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

ForwardStep = Callable[[Any], tuple[torch.Tensor, Any]]


def forward_backward_no_pipelining(forward_step: ForwardStep, micro_batches: Sequence[Any]) -> list[Any]:
    """Accumulate gradients over ``micro_batches``; return each micro-batch's report."""
    reports = []
    for micro_batch in micro_batches:
        loss, report = forward_step(micro_batch)
        loss.backward()
        reports.append(report)
    return reports


def get_forward_backward_func(pipeline_model_parallel_size: int):
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline parallelism is not implemented yet; use --pipeline-model-parallel-size 1")
