"""Pipeline schedules as pure functions: the ordered list of forward and backward steps each rank runs.

A schedule knows nothing of models or communication; ``megalite.pipeline.engine`` runs the list, receiving each
step's input from the neighbouring virtual stage and sending its output on. Keeping the order pure lets the tests
check it without processes: every forward precedes its backward, a simulation of the sends and receives completes
(no deadlock, messages consumed in the order sent on every link), and 1F1B keeps at most PP micro-batches in flight.

- No pipelining (PP = 1): forward and backward each micro-batch in turn (gradient accumulation).
- 1F1B (Narayanan et al. 2021): rank r runs PP - r - 1 warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards. Bubble (PP - 1) / M of the ideal time.
- Interleaved 1F1B: each rank holds V chunks; micro-batches go through the chunks in groups of PP, shrinking the
  bubble to (PP - 1) / (V M). Needs M to be a multiple of PP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Step:
    kind: Literal["F", "B"]
    chunk: int          # model chunk index on this rank (0 .. V-1)
    micro_batch: int


def no_pipelining(num_micro_batches: int) -> list[Step]:
    return [s for m in range(num_micro_batches) for s in (Step("F", 0, m), Step("B", 0, m))]


def one_f_one_b(pp: int, rank: int, num_micro_batches: int) -> list[Step]:
    warmup = min(pp - rank - 1, num_micro_batches)
    steps = [Step("F", 0, m) for m in range(warmup)]
    for i in range(num_micro_batches - warmup):
        steps += [Step("F", 0, warmup + i), Step("B", 0, i)]
    steps += [Step("B", 0, m) for m in range(num_micro_batches - warmup, num_micro_batches)]
    return steps


def interleaved_one_f_one_b(pp: int, rank: int, num_micro_batches: int, virtual_stages: int) -> list[Step]:
    """Megatron's interleaved order: virtual micro-batch k maps to a chunk and a micro-batch in groups of PP."""
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

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    steps = [forward_of(k) for k in range(warmup)]
    for i in range(total - warmup):
        steps += [forward_of(warmup + i), backward_of(i)]
    steps += [backward_of(k) for k in range(total - warmup, total)]
    return steps


def build_schedule(pp: int, rank: int, num_micro_batches: int, virtual_stages: int = 1) -> list[Step]:
    """The schedule the layout calls for."""
    if pp == 1:
        return no_pipelining(num_micro_batches)
    if virtual_stages == 1:
        return one_f_one_b(pp, rank, num_micro_batches)
    return interleaved_one_f_one_b(pp, rank, num_micro_batches, virtual_stages)


def peak_in_flight(steps: list[Step]) -> int:
    """Most micro-batches whose forward has run and backward has not (activations held), over all chunks."""
    live = peak = 0
    for step in steps:
        live += 1 if step.kind == "F" else -1
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class Message:
    """What one step needs from, or sends to, a neighbouring rank: an activation ("F") or a gradient ("B")."""
    kind: Literal["F", "B"]
    virtual_stage: int        # the stage that produced it
    micro_batch: int


def step_messages(step: Step, pp: int, virtual_stages: int, rank: int) -> tuple[Message | None, Message | None]:
    """(message this step receives, message it sends); None where the step is at an end of the pipeline."""
    stage = step.chunk * pp + rank
    last = pp * virtual_stages - 1
    if step.kind == "F":
        needs = Message("F", stage - 1, step.micro_batch) if stage > 0 else None
        sends = Message("F", stage, step.micro_batch) if stage < last else None
    else:
        needs = Message("B", stage + 1, step.micro_batch) if stage < last else None
        sends = Message("B", stage, step.micro_batch) if stage > 0 else None
    return needs, sends


def message_link(message: Message, pp: int) -> tuple[int, int]:
    """(sending rank, receiving rank) of a message: activations go to the next stage, gradients to the previous."""
    src = message.virtual_stage % pp
    dst = (src + 1) % pp if message.kind == "F" else (src - 1) % pp
    return src, dst
