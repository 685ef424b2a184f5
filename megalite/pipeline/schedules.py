"""Pipeline schedules as pure functions: the ordered list of steps each rank runs.

A schedule knows nothing of models or communication; ``megalite.pipeline.engine`` runs the list, receiving each
step's input from the neighbouring virtual stage and sending its output on. Keeping the order pure lets the tests
check it without processes: every forward precedes its backward, a simulation of the sends and receives completes,
the bubble of a unit-cost simulation (megalite.pipeline.simulation) matches the papers' formulas, and the number of
micro-batches held stays within 1F1B's.

A step is ``F`` (forward of one micro-batch through one chunk), ``B`` (its backward) or ``W``. Schedules without W
steps run the whole backward in B. Zero-bubble schedules (Qi et al. 2023) split it: B computes only the gradient of
the chunk's input, which is what the previous stage waits for, and each linear layer's weight gradient is left for
a later W step (megalite.tensor_parallel.weight_grad) that fills what would otherwise be idle time.

- No pipelining (PP = 1): forward and backward each micro-batch in turn (gradient accumulation).
- ``1f1b`` (Narayanan et al. 2021): rank r runs PP - r - 1 warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards; bubble (PP - 1) / M. Interleaved when V > 1: micro-batches go
  through the chunks in groups of PP, shrinking the bubble to (PP - 1) / (V M) (needs M to be a multiple of PP).
- ``zero-bubble`` (ZB-H1): 1F1B's order of F and B, B computing input gradients only, and rank r keeping up to r W
  steps deferred (flushed at the end), so that every rank holds the PP micro-batches rank 0 holds in 1F1B. A B then
  needs only the next stage's B, so the gradient returns in one step per stage, and the deferred Ws fill the drain:
  the bubble (PP - 1)(F + B + W) of 1F1B becomes (PP - 1)(F + B - W), (PP - 1) / (3M) with equal step costs.
  Interleaved when V > 1: the interleaved order with one warm-up forward per rank below the last (the gradient
  returns in one step, not two), the same W lag; (PP - 1) / (3 V M).
- ``zbv`` (ZB-V): the v-shape placement (megalite.pipeline.partition) with two chunks per rank, the order found by
  list scheduling at unit costs: every rank, whenever free, runs a B whose gradient has arrived, else a forward
  whose input has arrived while it holds fewer than 2 PP chunk-micro-batches (1F1B's activation memory), else its
  oldest deferred W. Each rank waits for its first input and nothing else: bubble (PP - 1) / (6M), with the
  activation memory of 1F1B. Qi et al.'s handcrafted ZB-V is one such order.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import Literal, Optional

from megalite.pipeline.partition import stage_rank, virtual_stage

SCHEDULES = ("1f1b", "zero-bubble", "zbv")


@dataclass(frozen=True)
class Step:
    kind: Literal["F", "B", "W"]
    chunk: int          # model chunk index on this rank (0 .. V-1)
    micro_batch: int


def placement_of(schedule: str) -> str:
    """How ``schedule`` places the chunks on the ranks (see megalite.pipeline.partition)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    return "v-shape" if schedule == "zbv" else "round-robin"


def no_pipelining(num_micro_batches: int) -> list[Step]:
    return [s for m in range(num_micro_batches) for s in (Step("F", 0, m), Step("B", 0, m))]


def one_f_one_b(pp: int, rank: int, num_micro_batches: int) -> list[Step]:
    warmup = min(pp - rank - 1, num_micro_batches)
    steps = [Step("F", 0, m) for m in range(warmup)]
    for i in range(num_micro_batches - warmup):
        steps += [Step("F", 0, warmup + i), Step("B", 0, i)]
    steps += [Step("B", 0, m) for m in range(num_micro_batches - warmup, num_micro_batches)]
    return steps


def interleaved_one_f_one_b(pp: int, rank: int, num_micro_batches: int, virtual_stages: int,
                            steps_per_hop: int = 2) -> list[Step]:
    """Megatron's interleaved order: virtual micro-batch k maps to a chunk and a micro-batch in groups of PP.

    ``steps_per_hop``: warm-up forwards per rank below the last, the steps a gradient takes to come back one stage
    (2 when B includes the weight gradient; 1 when it does not, for the zero-bubble variant)."""
    if num_micro_batches % pp:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({num_micro_batches}) to be a "
                         f"multiple of pipeline-model-parallel-size {pp}")
    v = virtual_stages
    total = num_micro_batches * v
    group = pp * v

    def forward_of(k: int) -> Step:
        return Step("F", (k % group) // pp, (k // group) * pp + k % pp)

    def backward_of(k: int) -> Step:
        return Step("B", v - 1 - (k % group) // pp, (k // group) * pp + k % pp)

    warmup = min((pp - rank - 1) * steps_per_hop + (v - 1) * pp, total)
    steps = [forward_of(k) for k in range(warmup)]
    for i in range(total - warmup):
        steps += [forward_of(warmup + i), backward_of(i)]
    steps += [backward_of(k) for k in range(total - warmup, total)]
    return steps


def defer_weight_gradients(steps: list[Step], lag: int) -> list[Step]:
    """Split each B of ``steps`` into B and a W, keeping up to ``lag`` Ws pending (oldest first out) and running
    the rest at the end."""
    result: list[Step] = []
    pending: deque[Step] = deque()
    for step in steps:
        result.append(step)
        if step.kind == "B":
            pending.append(step)
            if len(pending) > lag:
                done = pending.popleft()
                result.append(Step("W", done.chunk, done.micro_batch))
    return result + [Step("W", s.chunk, s.micro_batch) for s in pending]


def zero_bubble_h1(pp: int, rank: int, num_micro_batches: int, virtual_stages: int = 1) -> list[Step]:
    """ZB-H1, interleaved when V > 1 (see the module docstring)."""
    if virtual_stages == 1:
        base = one_f_one_b(pp, rank, num_micro_batches)
    else:
        base = interleaved_one_f_one_b(pp, rank, num_micro_batches, virtual_stages, steps_per_hop=1)
    return defer_weight_gradients(base, lag=rank)


@functools.lru_cache(maxsize=64)
def _zero_bubble_v_orders(pp: int, num_micro_batches: int) -> tuple[tuple[Step, ...], ...]:
    """Every rank's ZB-V order, by list scheduling at unit step costs (see the module docstring)."""
    m, placement, cap = num_micro_batches, "v-shape", 2 * pp
    last = 2 * pp - 1
    finished: dict[tuple[str, int, int], int] = {}     # (kind, virtual stage, micro-batch) -> time it ends
    orders: list[list[Step]] = [[] for _ in range(pp)]
    next_forward = [[0, 0] for _ in range(pp)]
    next_backward = [[0, 0] for _ in range(pp)]
    deferred: list[deque[Step]] = [deque() for _ in range(pp)]
    held = [0] * pp
    time = 0
    while any(len(order) < 6 * m for order in orders):
        for rank in range(pp):
            if orders[rank] and finished[_key(orders[rank][-1], rank, pp, placement)] > time:
                continue   # still running its last step

            def ready(kind: str, chunk: int) -> Optional[tuple[int, int]]:
                counter = next_forward if kind == "F" else next_backward
                micro_batch = counter[rank][chunk]
                if micro_batch >= m or (kind == "B" and micro_batch >= next_forward[rank][chunk]):
                    return None
                stage = virtual_stage(rank, chunk, pp, placement)
                if kind == "F":
                    needed = ("F", stage - 1, micro_batch) if stage > 0 else None
                else:
                    needed = ("B", stage + 1, micro_batch) if stage < last else ("F", stage, micro_batch)
                if needed is not None and finished.get(needed, time + 1) > time:
                    return None
                return micro_batch, -stage   # oldest micro-batch first, then the stage further down the pipeline

            step = None
            for kind in ("B", "F"):
                if kind == "F" and held[rank] >= cap:
                    continue
                candidates = [(key, chunk) for chunk in (0, 1) if (key := ready(kind, chunk)) is not None]
                if candidates:
                    (micro_batch, _), chunk = min(candidates)
                    step = Step(kind, chunk, micro_batch)
                    break
            if step is None and deferred[rank]:
                done = deferred[rank].popleft()
                step = Step("W", done.chunk, done.micro_batch)
            if step is None:
                continue
            finished[_key(step, rank, pp, placement)] = time + 1
            orders[rank].append(step)
            if step.kind == "F":
                next_forward[rank][step.chunk] += 1
                held[rank] += 1
            elif step.kind == "B":
                next_backward[rank][step.chunk] += 1
                deferred[rank].append(step)
            else:
                held[rank] -= 1
        time += 1
        if time > 12 * (m + pp):   # every rank runs 6m unit steps after at most PP - 1 of waiting
            raise RuntimeError(f"ZB-V list scheduling made no progress (PP={pp}, M={m})")
    return tuple(tuple(order) for order in orders)


def _key(step: Step, rank: int, pp: int, placement: str) -> tuple[str, int, int]:
    return step.kind, virtual_stage(rank, step.chunk, pp, placement), step.micro_batch


def zero_bubble_v(pp: int, rank: int, num_micro_batches: int) -> list[Step]:
    """ZB-V (see the module docstring)."""
    return list(_zero_bubble_v_orders(pp, num_micro_batches)[rank])


def build_schedule(pp: int, rank: int, num_micro_batches: int, virtual_stages: int = 1,
                   schedule: str = "1f1b") -> list[Step]:
    """The steps ``schedule`` runs on pipeline rank ``rank`` (PP = 1: no pipelining, whatever the schedule)."""
    placement_of(schedule)   # a known name
    if pp == 1:
        return no_pipelining(num_micro_batches)
    if schedule == "zbv":
        if virtual_stages != 2:
            raise ValueError(f"the zbv schedule runs exactly 2 chunks per rank, got {virtual_stages}")
        return zero_bubble_v(pp, rank, num_micro_batches)
    if schedule == "zero-bubble":
        return zero_bubble_h1(pp, rank, num_micro_batches, virtual_stages)
    if virtual_stages == 1:
        return one_f_one_b(pp, rank, num_micro_batches)
    return interleaved_one_f_one_b(pp, rank, num_micro_batches, virtual_stages)


def splits_backward(steps: list[Step]) -> bool:
    """Whether ``steps`` leave weight gradients to W steps (so B computes input gradients only)."""
    return any(step.kind == "W" for step in steps)


def peak_in_flight(steps: list[Step]) -> int:
    """Most micro-batches whose forward has run and backward has not finished (activations held), over all chunks:
    a micro-batch is held until its W where weight gradients are deferred, else until its B."""
    releasing = "W" if splits_backward(steps) else "B"
    live = peak = 0
    for step in steps:
        live += 1 if step.kind == "F" else -1 if step.kind == releasing else 0
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class Message:
    """What one step needs from, or sends to, a neighbouring stage: an activation ("F") or a gradient ("B")."""
    kind: Literal["F", "B"]
    virtual_stage: int        # the stage that produced it
    micro_batch: int


def step_messages(step: Step, pp: int, virtual_stages: int, rank: int,
                  placement: str = "round-robin") -> tuple[Message | None, Message | None]:
    """(message this step receives, message it sends); None where the step is at an end of the pipeline or, for W
    steps, always."""
    if step.kind == "W":
        return None, None
    stage = virtual_stage(rank, step.chunk, pp, placement)
    last = pp * virtual_stages - 1
    if step.kind == "F":
        needs = Message("F", stage - 1, step.micro_batch) if stage > 0 else None
        sends = Message("F", stage, step.micro_batch) if stage < last else None
    else:
        needs = Message("B", stage + 1, step.micro_batch) if stage < last else None
        sends = Message("B", stage, step.micro_batch) if stage > 0 else None
    return needs, sends


def message_link(message: Message, pp: int, placement: str = "round-robin") -> tuple[int, int]:
    """(sending rank, receiving rank) of a message: activations go to the next stage, gradients to the previous.
    The two are equal where consecutive stages share a rank (the bottom of the v-shape): a local hand-over."""
    src = stage_rank(message.virtual_stage, pp, placement)
    dst = stage_rank(message.virtual_stage + (1 if message.kind == "F" else -1), pp, placement)
    return src, dst
