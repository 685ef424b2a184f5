"""Running a schedule: forward, backward and weight-gradient steps on this rank's model chunks, with the transfers.

``forward_step(chunk, micro_batch, input_tensor)`` is the caller's: it returns the chunk's output activation, or on
the last virtual stage the loss to backpropagate. The engine follows a :class:`~megalite.pipeline.transfers.RankPlan`
round by round: it posts the round's batch (the send of what the previous step produced, the receives of what the
neighbours produced meanwhile) and runs the round's step, waiting only for the message that step needs; receives
posted rounds ahead of their step transfer during the compute in between. Each micro-batch's input and output are
kept until its backward; an output's data is
freed once it has been sent (the next stage has it; the backward needs only its graph). Where the schedule has W
steps, each B runs inside ``weight_grads.deferring`` and each W runs the weight gradients its B left
(megalite.tensor_parallel.weight_grad). Consecutive stages on one rank (the bottom of the v-shape) hand over
directly. Each schedule's steps' times (from the start of the schedule, with the wall-clock time it
started: the ranks' common clock) are kept in the stats for timelines (megalite.training.step_times).

Time: the engine never synchronizes the device. It measures, per rank, the busy time of its steps and the wall
time of the schedule so the bubble can be read: on the CPU with the host clock (CPU ops run synchronously, so
that is their cost); on a GPU, only when asked (``--timing-log-level`` >= 1), with a CUDA event recorded on the
compute stream before and after each step and read once at the end of the schedule, so busy time is the GPU's time
in the steps' kernels and the gaps between steps are when it waited for transfers. The trainer turns these into
the bubble: idle over busy time up to the end of the slowest rank (megalite.pipeline.simulation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megalite.pipeline.p2p import PipelineLinks
from megalite.pipeline.schedules import Step, splits_backward
from megalite.pipeline.transfers import RankPlan
from megalite.tensor_parallel.weight_grad import WeightGradStore

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]


@dataclass
class ScheduleStats:
    busy_s: Optional[float] = None    # time in the steps' compute (None: not measured)
    total_s: Optional[float] = None   # wall time of the whole schedule
    peak_in_flight: int = 0           # most micro-batches whose activations were held at once
    freed_bytes: int = 0              # sent activations' data released before their backward
    # After each step: (bytes of the kept outputs' data still allocated, bytes they would hold if never freed).
    output_bytes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # (start, end) of each step in seconds from the schedule's start, when measured; and when it started (time.time()).
    step_times: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    wall_start: float = 0.0

    @property
    def idle_fraction(self) -> float:
        """Idle time over the schedule's wall time."""
        return 1.0 - self.busy_s / self.total_s if self.total_s else 0.0


class StepClock:
    """Busy time of the steps and wall time of the schedule: host clock on the CPU, CUDA events on a GPU when
    ``measure_gpu``, nothing otherwise (see the module docstring)."""

    def __init__(self, device: torch.device, measure_gpu: bool = False):
        self.events = device.type == "cuda"
        self.enabled = measure_gpu or not self.events
        self._marks: list = []
        self.step_times: list[tuple[float, float]] = []   # of the last schedule measured, from its start
        self.wall_start = 0.0

    def _mark(self):
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def step(self):
        if not self.enabled:
            yield
            return
        start = self._mark()
        yield
        self._marks.append((start, self._mark()))

    def measure(self, body: Callable[[], None]) -> tuple[Optional[float], Optional[float]]:
        """Run ``body`` (the schedule), returning (busy seconds, total seconds)."""
        if not self.enabled:
            body()
            return None, None
        self._marks = []
        self.wall_start = time.time()
        start = self._mark()
        body()
        end = self._mark()
        if self.events:
            end.synchronize()   # once per schedule, and only when timing was asked for
            elapsed = lambda a, b: a.elapsed_time(b) / 1000.0   # noqa: E731 - milliseconds to seconds
        else:
            elapsed = lambda a, b: b - a   # noqa: E731
        self.step_times = [(elapsed(start, a), elapsed(start, b)) for a, b in self._marks]
        return sum(elapsed(a, b) for a, b in self._marks), elapsed(start, end)


def run_schedule(plan: RankPlan, forward_step: ForwardStep, links: PipelineLinks | None, *,
                 forward_only: bool = False, weight_grads: WeightGradStore | None = None,
                 clock: StepClock | None = None,
                 after_step: Callable[[Step], None] | None = None) -> ScheduleStats:
    """Run ``plan``'s steps (forward steps only, outputs not kept, when ``forward_only``: evaluation).
    ``after_step`` is called after each step (memory probes in tests)."""
    stats = ScheduleStats()
    defer = splits_backward(list(plan.steps)) and not forward_only
    if defer and weight_grads is None:
        raise ValueError("a schedule with W steps needs a WeightGradStore attached to the model's linear layers")
    clock = clock or StepClock(torch.device("cpu"))
    inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    held: set[tuple[int, int]] = set()
    local: dict = {}   # hand-overs between this rank's own chunks
    outbox: dict = {}  # message -> (destination rank, tensor, free once sent), posted in the next round

    def body() -> None:
        for round_ in plan.rounds:
            if links is not None:   # what was sent two rounds ago has been received (or soon is): free it
                links.reap_sends(wait_before_round=round_.index - 1)
            if round_.sends or round_.receives:
                links.post([outbox.pop(m) for m in round_.sends], list(round_.receives), round_.index)
            step = round_.step
            if step is None:
                continue
            needs, sends = plan.messages(step)
            received = None
            if needs is not None:
                received = local.pop(needs) if plan.link(needs)[0] == plan.rank else links.take(needs)
            key = (step.chunk, step.micro_batch)
            with clock.step():
                if step.kind == "F":
                    input_tensor = received.requires_grad_(not forward_only) if received is not None else None
                    produced = forward_step(step.chunk, step.micro_batch, input_tensor)
                    if not forward_only:
                        inputs[key], outputs[key] = input_tensor, produced
                        held.add(key)
                    stats.peak_in_flight = max(stats.peak_in_flight, len(held) or 1)
                elif step.kind == "B":
                    output, input_tensor = outputs.pop(key), inputs.pop(key)
                    with weight_grads.deferring(key) if defer else contextlib.nullcontext():
                        torch.autograd.backward(output, grad_tensors=received)
                    produced = input_tensor.grad if input_tensor is not None else None
                    if not defer:
                        held.discard(key)
                else:
                    weight_grads.run(key)
                    held.discard(key)
            if sends is not None:
                destination = plan.link(sends)[1]
                if destination == plan.rank:
                    local[sends] = produced.detach()
                else:   # a forward's output is freed once sent, unless it is a view of something else
                    free = step.kind == "F" and not forward_only and produced._base is None
                    outbox[sends] = (destination, produced, free)
            if links is not None:
                links.reap_sends()   # free what has been sent meanwhile (where the backend can tell)
            if not forward_only:
                stats.output_bytes.append((sum(o.untyped_storage().nbytes() for o in outputs.values()),
                                           sum(o.numel() * o.element_size() for o in outputs.values())))
            if after_step is not None:
                after_step(step)
        if links is not None:
            links.finish()

    freed_before = links.freed_bytes if links is not None else 0
    stats.busy_s, stats.total_s = clock.measure(body)
    stats.step_times, stats.wall_start = list(clock.step_times), clock.wall_start
    stats.freed_bytes = (links.freed_bytes if links is not None else 0) - freed_before
    return stats
