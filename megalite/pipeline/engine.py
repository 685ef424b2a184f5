"""Running a schedule: forward and backward steps on this rank's model chunks, with the pipeline transfers.

``forward_step(chunk, micro_batch, input_tensor)`` is the caller's: it returns the chunk's output activation, or on
the last virtual stage the loss to backpropagate. The engine keeps each micro-batch's input and output until its
backward, receives what a step needs just before it and sends what it produced with the next exchange. It also
measures, per rank, the time spent computing and the peak number of micro-batches held, so the bubble can be read:
``bubble_fraction`` is idle time over compute time, the quantity (PP - 1) / (V M) of Narayanan et al. 2021 predicts.
Asked to (``record_steps``), it keeps each step's start and end, in seconds from the start of the schedule (whose
wall-clock time, ``wall_start``, puts the ranks on one clock), for timelines (megalite.training.step_times).
On GPUs the timers synchronize the device around each step (a small cost, paid for an honest reading).

Not done yet (Megatron does both): freeing an output's data once it is sent (the next stage holds it), and posting
the next receive before the current step computes, so transfer latency hides behind compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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
    step_times: list[tuple[float, float]] = field(default_factory=list)   # (start, end) per step, if recorded
    wall_start: float = 0.0      # time.time() when the schedule started: the ranks' common clock

    @property
    def idle_fraction(self) -> float:
        """Idle time over the schedule's wall time."""
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Idle time over compute time: what (PP - 1) / (V M) predicts for equal step costs."""
        return (self.total_s - self.busy_s) / self.busy_s if self.busy_s > 0 else 0.0


def run_schedule(steps: list[Step], forward_step: ForwardStep, *, pp: int, rank: int, virtual_stages: int,
                 links: PipelineLinks | None, forward_only: bool = False,
                 record_steps: bool = False) -> ScheduleStats:
    """Run ``steps`` (forward steps only, outputs not kept, when ``forward_only``: evaluation); ``record_steps``
    fills ``step_times``."""
    stats = ScheduleStats()
    inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    pending_sends: list[tuple[int, torch.Tensor]] = []
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    synchronize()
    start, stats.wall_start = time.perf_counter(), time.time()
    for step in steps:
        needs, sends = step_messages(step, pp, virtual_stages, rank)
        recv_from = [message_link(needs, pp)[0]] if needs is not None else []
        received = links.exchange(pending_sends, recv_from) if (pending_sends or recv_from) else []
        pending_sends = []
        key = (step.chunk, step.micro_batch)

        synchronize()   # a received tensor may still be in flight on the GPU
        compute_start = time.perf_counter()
        if step.kind == "F":
            input_tensor = received[0].requires_grad_(not forward_only) if received else None
            produced = forward_step(step.chunk, step.micro_batch, input_tensor)
            if not forward_only:
                inputs[key], outputs[key] = input_tensor, produced
            stats.peak_in_flight = max(stats.peak_in_flight, len(outputs) or 1)
        else:
            output, input_tensor = outputs.pop(key), inputs.pop(key)
            torch.autograd.backward(output, grad_tensors=received[0] if received else None)
            produced = input_tensor.grad if input_tensor is not None else None
        synchronize()
        compute_end = time.perf_counter()
        stats.busy_s += compute_end - compute_start
        if record_steps:
            stats.step_times.append((compute_start - start, compute_end - start))

        if sends is not None:
            pending_sends.append((message_link(sends, pp)[1], produced))
    if pending_sends:
        links.exchange(pending_sends, [])
    if links is not None:
        links.finish()
    synchronize()
    stats.total_s = time.perf_counter() - start
    return stats
