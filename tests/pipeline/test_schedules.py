"""Schedules as orderings, checked without processes: completeness, forward-before-backward, no deadlock when the
sends and receives are simulated (with messages consumed in the order sent on each link, as NCCL requires), and the
number of micro-batches held at once."""

from __future__ import annotations

import pytest

from megalite.pipeline.partition import chunks_of_rank
from megalite.pipeline.schedules import (build_schedule, interleaved_one_f_one_b, message_link, peak_in_flight,
                                         step_messages)

LAYOUTS = [(pp, v, m) for pp in (2, 4) for v in (1, 2) for m in (pp, 2 * pp, 3 * pp, 8)
           if v == 1 or m % pp == 0]


def simulate(pp: int, v: int, m: int) -> int:
    """Run every rank's schedule with asynchronous sends and blocking receives; return the number of rounds.

    A receive may only take the oldest unconsumed message on its link: it must be the one it expects."""
    schedules = [build_schedule(pp, r, m, v) for r in range(pp)]
    position = [0] * pp
    links: dict[tuple[int, int], list] = {}
    rounds = 0
    while any(position[r] < len(schedules[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if position[r] == len(schedules[r]):
                continue
            needs, sends = step_messages(schedules[r][position[r]], pp, v, r)
            if needs is not None:
                queue = links.get(message_link(needs, pp), [])
                if not queue:
                    continue
                assert queue[0] == needs, f"rank {r} expects {needs} but the link delivers {queue[0]} first"
                queue.pop(0)
            if sends is not None:
                links.setdefault(message_link(sends, pp), []).append(sends)
            position[r] += 1
            progressed = True
        assert progressed, f"deadlock at positions {position} for PP={pp} V={v} M={m}"
        rounds += 1
    assert all(not queue for queue in links.values()), "messages sent but never received"
    return rounds


@pytest.mark.parametrize("pp, v, m", LAYOUTS)
def test_every_step_once_and_forward_before_backward(pp, v, m):
    for rank in range(pp):
        steps = build_schedule(pp, rank, m, v)
        expected = {(kind, c, mb) for kind in "FB" for c in range(v) for mb in range(m)}
        assert sorted((s.kind, s.chunk, s.micro_batch) for s in steps) == sorted(expected)
        position = {(s.kind, s.chunk, s.micro_batch): i for i, s in enumerate(steps)}
        assert all(position[("F", c, mb)] < position[("B", c, mb)] for c in range(v) for mb in range(m))


@pytest.mark.parametrize("pp, v, m", LAYOUTS)
def test_simulated_exchange_completes(pp, v, m):
    simulate(pp, v, m)


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 12)])
def test_one_f_one_b_holds_at_most_pp_micro_batches(pp, m):
    peaks = [peak_in_flight(build_schedule(pp, r, m)) for r in range(pp)]
    assert peaks[0] == pp
    assert peaks == [pp - r for r in range(pp)]    # later stages hold fewer


def test_fewer_micro_batches_than_stages_still_completes():
    assert peak_in_flight(build_schedule(4, 0, 2)) == 2
    simulate(4, 1, 2)


def test_no_pipelining_alternates():
    assert [(s.kind, s.micro_batch) for s in build_schedule(1, 0, 3)] == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_interleaved_needs_multiple_of_pp():
    with pytest.raises(ValueError, match="multiple of pipeline-model-parallel-size 4"):
        interleaved_one_f_one_b(4, 0, 6, 2)


def test_chunks_round_robin_over_ranks():
    # The example: PP=2, V=2, 8 layers -> rank 0 holds layers 0-1 and 4-5.
    rank0 = chunks_of_rank(8, 2, 2, 0)
    assert [(c.first_layer, c.num_layers) for c in rank0] == [(0, 2), (4, 2)]
    assert rank0[0].is_first and not rank0[1].is_last
    rank1 = chunks_of_rank(8, 2, 2, 1)
    assert [(c.first_layer, c.num_layers) for c in rank1] == [(2, 2), (6, 2)]
    assert rank1[1].is_last
    layers = sorted(l for r in range(4) for c in chunks_of_rank(12, 4, 1, r)
                    for l in range(c.first_layer, c.first_layer + c.num_layers))
    assert layers == list(range(12))
    with pytest.raises(ValueError, match="num-layers 10 is not divisible"):
        chunks_of_rank(10, 4, 1, 0)

