"""When each pipeline rank sends and receives each message: a pure plan derived from every rank's schedule.

The plan comes from running all ranks' steps in lockstep rounds: in each round a rank runs its next step if that
step's input was produced in an earlier round. In round t every rank posts one batch holding the sends of what
its step of round t-1 produced and the receives of what its neighbours produced in round t-1, then runs its step of
round t (if it has one), waiting only for that step's own input.

Why rounds: point-to-point messages between two ranks are matched in the order they are posted (NCCL, and gloo
without tags), and NCCL runs a rank's batches one after another, a send completing only with its receive. With
rounds, every operation in a rank's round-t batch is matched by one in its neighbour's round-t batch, so once all
batches of round t-1 have completed every batch of round t can run: no cycle of ranks waiting on each other
whatever the schedule, and each link carries its messages in the order they are produced. A message is received
in the round after it is produced, which may be well before the step that needs it: the receive is posted before
the compute of the steps in between and its transfer overlaps them (ZB-V and the interleaved zero-bubble order
consume some messages in another order than their link delivers them, and keep the early ones until needed). The
same run proves the schedules can finish (every needed message sent, no cycle of steps).

A rank may also wait, at the start of round t, for its sends of an earlier round to complete (to free what they sent:
gloo reports a send done only when waited for): their receives are in the receivers' batches of that same round,
which every rank that has reached round t has posted, so the rank furthest behind never waits. The engine waits for
those of round t-2 and earlier, leaving its neighbours a round of slack.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.pipeline.schedules import Message, Step, message_link, step_messages


@dataclass(frozen=True)
class Round:
    """One round of one rank: the batch it posts, then the step it runs (None: it only exchanges)."""
    index: int                                    # the round's number, the same on every rank
    sends: tuple[Message, ...]                    # produced by this rank's step of the previous round
    receives: tuple[tuple[int, Message], ...]     # (source rank, message) produced by a neighbour last round
    step: Step | None


@dataclass(frozen=True)
class RankPlan:
    """What one pipeline rank runs, round by round (rounds with nothing to do are left out)."""
    rounds: tuple[Round, ...]
    pp: int
    rank: int
    virtual_stages: int
    placement: str

    @property
    def steps(self) -> list[Step]:
        return [r.step for r in self.rounds if r.step is not None]

    def messages(self, step: Step) -> tuple[Message | None, Message | None]:
        return step_messages(step, self.pp, self.virtual_stages, self.rank, self.placement)

    def link(self, message: Message) -> tuple[int, int]:
        return message_link(message, self.pp, self.placement)


def plan_transfers(schedules: list[list[Step]], pp: int, virtual_stages: int,
                   placement: str = "round-robin") -> list[RankPlan]:
    """Every rank's :class:`RankPlan` for ``schedules`` (one list of steps per rank; see the module docstring).
    Raises ValueError when the schedules cannot run to the end."""
    produced: dict[Message, int] = {}                                  # message -> round it was produced in
    position = [0] * pp
    rounds: list[list[Round]] = [[] for _ in range(pp)]
    sending: list[list[Message]] = [[] for _ in range(pp)]              # produced last round, to send now
    arriving: list[list[tuple[int, Message]]] = [[] for _ in range(pp)]
    now = 0
    while any(position[r] < len(schedules[r]) for r in range(pp)) or any(sending):
        ran = []
        for rank in range(pp):
            step = schedules[rank][position[rank]] if position[rank] < len(schedules[rank]) else None
            if step is not None:
                needs = step_messages(step, pp, virtual_stages, rank, placement)[0]
                if needs is not None and produced.get(needs, now) >= now:
                    step = None   # its input is not there yet
            rounds[rank].append(Round(now, tuple(sending[rank]), tuple(arriving[rank]), step))
            ran.append(step)
        sending, arriving = [[] for _ in range(pp)], [[] for _ in range(pp)]
        for rank, step in enumerate(ran):
            if step is None:
                continue
            position[rank] += 1
            sends = step_messages(step, pp, virtual_stages, rank, placement)[1]
            if sends is not None:
                produced[sends] = now
                destination = message_link(sends, pp, placement)[1]
                if destination != rank:   # not a hand-over between two chunks of this rank
                    sending[rank].append(sends)
                    arriving[destination].append((rank, sends))
        if all(step is None for step in ran) and any(position[r] < len(schedules[r]) for r in range(pp)):
            raise ValueError(f"the schedules deadlock: ranks stop at steps {position} of "
                             f"{[len(s) for s in schedules]}")
        now += 1
    return [RankPlan(tuple(r for r in rank_rounds if r.sends or r.receives or r.step is not None), pp, rank,
                     virtual_stages, placement) for rank, rank_rounds in enumerate(rounds)]
