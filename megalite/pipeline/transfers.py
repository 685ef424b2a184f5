"""When each pipeline rank posts each receive: a pure plan derived from every rank's schedule.

Messages on one link (sending rank -> receiving rank) are matched in the order they are sent: NCCL matches
point-to-point operations between two ranks in order, and so does gloo without tags. A schedule may consume them in
another order (ZB-V and the interleaved zero-bubble order do where activations and gradients share a link), so a
receiver posts its receives in the sender's order and keeps early arrivals until their step needs them.

Before step i a rank posts, in one batch with the send of step i-1's output:

- the receive of the message step i needs, after those sent before it on the same link;
- the receive step i+1 needs (also in link order) when its sender does not depend on this rank's step i or any
  later one, so that the transfer runs during step i's compute (Megatron overlaps its p2p the same way). A receive
  posted any earlier could deadlock under NCCL, whose point-to-point operations run one batch after the other: it
  would wait for a message that needs this rank's next send, queued behind it.

The dependencies come from one pass over all ranks' steps in an order they can run in: each step records, for every
rank, the last step of that rank it depends on, directly or through messages (program order makes that one number
per rank). The pass also proves the schedules can run at all (every needed message sent, no cycle).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megalite.pipeline.schedules import Message, Step, message_link, step_messages


@dataclass(frozen=True)
class RankPlan:
    """What one pipeline rank runs: its steps and, per step, the receives (source rank, message) to post just
    before it."""
    steps: tuple[Step, ...]
    receives: tuple[tuple[tuple[int, Message], ...], ...]
    pp: int
    rank: int
    virtual_stages: int
    placement: str

    def messages(self, step: Step) -> tuple[Message | None, Message | None]:
        return step_messages(step, self.pp, self.virtual_stages, self.rank, self.placement)

    def link(self, message: Message) -> tuple[int, int]:
        return message_link(message, self.pp, self.placement)


def dependencies(schedules: list[list[Step]], pp: int, virtual_stages: int,
                 placement: str) -> tuple[list[list[tuple[int, ...]]], dict[Message, tuple[int, int]]]:
    """(per rank and step, the last step of every rank it depends on (-1: none); the (rank, step) sending each
    message). Raises ValueError when the schedules cannot run to the end."""
    producers: dict[Message, tuple[int, int]] = {}
    for rank, steps in enumerate(schedules):
        for index, step in enumerate(steps):
            sends = step_messages(step, pp, virtual_stages, rank, placement)[1]
            if sends is not None:
                producers[sends] = (rank, index)
    depends: list[list] = [[None] * len(steps) for steps in schedules]
    position = [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for rank, steps in enumerate(schedules):
            while position[rank] < len(steps):
                index = position[rank]
                needs = step_messages(steps[index], pp, virtual_stages, rank, placement)[0]
                frontier = list(depends[rank][index - 1]) if index else [-1] * pp
                if needs is not None:
                    if needs not in producers:
                        raise ValueError(f"rank {rank} step {index} ({steps[index]}) needs {needs}, which no step sends")
                    source = depends[producers[needs][0]][producers[needs][1]]
                    if source is None:
                        break
                    frontier = [max(a, b) for a, b in zip(frontier, source)]
                frontier[rank] = index
                depends[rank][index] = tuple(frontier)
                position[rank] += 1
                progressed = True
    if any(position[r] < len(schedules[r]) for r in range(pp)):
        raise ValueError(f"the schedules deadlock: ranks stop at steps {position} of "
                         f"{[len(s) for s in schedules]}")
    return depends, producers


def plan_transfers(schedules: list[list[Step]], pp: int, virtual_stages: int,
                   placement: str = "round-robin") -> list[RankPlan]:
    """Every rank's :class:`RankPlan` for ``schedules`` (one list of steps per rank; see the module docstring)."""
    depends, producers = dependencies(schedules, pp, virtual_stages, placement)
    link_order: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for rank, steps in enumerate(schedules):
        for step in steps:
            sends = step_messages(step, pp, virtual_stages, rank, placement)[1]
            if sends is not None and message_link(sends, pp, placement)[1] != rank:
                link_order[message_link(sends, pp, placement)].append(sends)
    place_on_link = {m: k for order in link_order.values() for k, m in enumerate(order)}

    plans = []
    for rank, steps in enumerate(schedules):
        posted: dict[tuple[int, int], int] = defaultdict(int)   # link -> how many of its messages are posted

        def drain(message: Message | None) -> list[tuple[int, Message]]:
            """The receives up to ``message`` on its link not yet posted (none for a local hand-over)."""
            if message is None or message_link(message, pp, placement)[0] == rank:
                return []
            link = message_link(message, pp, placement)
            start, end = posted[link], place_on_link[message] + 1
            posted[link] = max(start, end)
            return [(link[0], m) for m in link_order[link][start:end]]

        receives = []
        for index, step in enumerate(steps):
            posts = drain(step_messages(step, pp, virtual_stages, rank, placement)[0])
            if index + 1 < len(steps):
                ahead = step_messages(steps[index + 1], pp, virtual_stages, rank, placement)[0]
                if ahead is not None and depends[producers[ahead][0]][producers[ahead][1]][rank] < index:
                    posts += drain(ahead)
            receives.append(tuple(posts))
        plans.append(RankPlan(tuple(steps), tuple(receives), pp, rank, virtual_stages, placement))
    return plans
