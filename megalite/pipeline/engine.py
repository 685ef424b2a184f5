"""Running a schedule: forward and backward steps on this rank's model chunks, with the pipeline transfers.

``forward_step(chunk, micro_batch, input_tensor)`` is the caller's: it returns the chunk's output activation, or on
the last virtual stage the loss to backpropagate. The engine keeps each micro-batch's input and output until its
backward, receives what a step needs just before it and sends what it produced with the next exchange. It also
measures, per rank, the time spent computing and the peak number of micro-batches held, so the bubble can be read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megalite.pipeline.p2p import PipelineLinks
from megalite.pipeline.schedules import Step, message_link, step_messages

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]


@dataclass
class ScheduleStats:
    busy_s: float = 0.0          # time in forward/backward compute
    total_s: float = 0.0         # wall time of the whole schedule
    peak_in_flight: int = 0      # most micro-batches whose activations were held at once

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


def run_schedule(steps: list[Step], forward_step: ForwardStep, *, pp: int, rank: int, virtual_stages: int,
                 links: PipelineLinks | None) -> ScheduleStats:
    stats = ScheduleStats()
    inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    pending_sends: list[tuple[int, torch.Tensor]] = []
    start = time.perf_counter()
    for step in steps:
        needs, sends = step_messages(step, pp, virtual_stages, rank)
        recv_from = [message_link(needs, pp)[0]] if needs is not None else []
        received = links.exchange(pending_sends, recv_from) if (pending_sends or recv_from) else []
        pending_sends = []
        key = (step.chunk, step.micro_batch)

        compute_start = time.perf_counter()
        if step.kind == "F":
            input_tensor = received[0].requires_grad_() if received else None
            inputs[key] = input_tensor
            outputs[key] = forward_step(step.chunk, step.micro_batch, input_tensor)
            produced = outputs[key]
            stats.peak_in_flight = max(stats.peak_in_flight, len(outputs))
        else:
            output, input_tensor = outputs.pop(key), inputs.pop(key)
            torch.autograd.backward(output, grad_tensors=received[0] if received else None)
            produced = input_tensor.grad if input_tensor is not None else None
        stats.busy_s += time.perf_counter() - compute_start

        if sends is not None:
            pending_sends.append((message_link(sends, pp)[1], produced))
    if pending_sends:
        links.exchange(pending_sends, [])
    if links is not None:
        links.finish()
    stats.total_s = time.perf_counter() - start
    return stats
