"""Schedules as orderings, checked without processes: completeness, F before B before W, the transfer plan run
under gloo's and NCCL's matching rules without deadlock, the unit-cost bubble against the papers' formulas, and
the number of micro-batches held at once."""

from __future__ import annotations

from collections import defaultdict

import pytest

from megalite.pipeline.partition import chunks_of_rank, stage_rank, virtual_stage
from megalite.pipeline.schedules import (SCHEDULES, build_schedule, interleaved_one_f_one_b, peak_in_flight,
                                         placement_of)
from megalite.pipeline.simulation import bubble_formula, schedule_bubble, simulate
from megalite.pipeline.transfers import plan_transfers

LAYOUTS = [(s, pp, v, m) for s in SCHEDULES for pp in (2, 3, 4) for v in ((2,) if s == "zbv" else (1, 2))
           for m in (1, pp - 1, pp, 2 * pp, 3 * pp, 8) if m >= 1 and (v == 1 or s == "zbv" or m % pp == 0)]


def plans(schedule, pp, v, m):
    steps = [build_schedule(pp, r, m, v, schedule) for r in range(pp)]
    return steps, plan_transfers(steps, pp, v, placement_of(schedule))


def run_transfers(plans, nccl: bool, send_lag: int = 2) -> None:
    """Execute every rank's plan as the engine does: each round, wait for its sends of ``send_lag`` or more rounds
    ago (to free what they sent), post the round's batch, then run its step once the step's own input has arrived.

    Matching: the k-th receive posted on a link takes the k-th message sent on it, which must be the one it was
    posted for. gloo (``nccl=False``): posted operations progress independently. NCCL: a rank's batches run one
    after another, a batch only once the previous one has completed, and a send and its receive complete together
    once both their batches are running. Fails on a deadlock."""
    pp = len(plans)
    batches = [[] for _ in range(pp)]    # per rank: posted batches, each a list of [kind, link, message, done]
    batch_round = [[] for _ in range(pp)]   # per rank: the round of each posted batch
    completed = [0] * pp                 # per rank: batches completed (in order)
    position = [0] * pp                  # per rank: next round
    posted = [False] * pp                # whether that round's batch is posted
    ops_on = defaultdict(lambda: {"send": [], "recv": []})   # link -> (rank, batch index, op) in posting order

    def running(rank, index):
        return not nccl or completed[rank] >= index

    while True:
        progressed = False
        for r, plan in enumerate(plans):
            while position[r] < len(plan.rounds):
                round_ = plan.rounds[position[r]]
                if not posted[r] and any(not op[3] for b, index in zip(batches[r], batch_round[r])
                                         if index <= round_.index - send_lag for op in b if op[0] == "send"):
                    break   # waiting for an old send to complete
                if not posted[r]:
                    batch = ([["send", plan.link(m), m, False] for m in round_.sends]
                             + [["recv", (source, r), m, False] for source, m in round_.receives])
                    if batch:
                        batches[r].append(batch)
                        batch_round[r].append(round_.index)
                        for op in batch:
                            ops_on[op[1]][op[0]].append((r, len(batches[r]) - 1, op))
                    posted[r] = progressed = True
                needs = plan.messages(round_.step)[0] if round_.step is not None else None
                if needs is not None and plan.link(needs)[0] != r:
                    op = next((op for b in batches[r] for op in b if op[0] == "recv" and op[2] == needs), None)
                    assert op is not None, f"rank {r}: {round_.step} needs {needs}, never posted"
                    if not op[3]:
                        break
                position[r] += 1
                posted[r], progressed = False, True
        for link, ops in ops_on.items():
            assert len(ops["recv"]) <= len(ops["send"]) or not all(
                position[r] == len(plans[r].rounds) for r in range(pp)), f"link {link}: receives never sent"
            for (sr, sb, send), (rr, rb, recv) in zip(ops["send"], ops["recv"]):
                assert send[2] == recv[2], f"link {link}: {recv[2]} posted where {send[2]} arrives"
                if not send[3] and running(sr, sb) and running(rr, rb):
                    send[3] = recv[3] = progressed = True
        for r in range(pp):
            while completed[r] < len(batches[r]) and all(op[3] for op in batches[r][completed[r]]):
                completed[r] += 1
                progressed = True
        if all(position[r] == len(plans[r].rounds) and completed[r] == len(batches[r]) for r in range(pp)):
            break
        assert progressed, f"deadlock ({'NCCL' if nccl else 'gloo'} rules) at rounds {position}"


@pytest.mark.parametrize("schedule, pp, v, m", LAYOUTS)
def test_every_step_once_in_dependency_order(schedule, pp, v, m):
    for rank in range(pp):
        steps = build_schedule(pp, rank, m, v, schedule)
        kinds = "FBW" if schedule != "1f1b" else "FB"
        expected = {(kind, c, mb) for kind in kinds for c in range(v) for mb in range(m)}
        assert sorted((s.kind, s.chunk, s.micro_batch) for s in steps) == sorted(expected)
        position = {(s.kind, s.chunk, s.micro_batch): i for i, s in enumerate(steps)}
        for c in range(v):
            for mb in range(m):
                assert position[("F", c, mb)] < position[("B", c, mb)] < position.get(("W", c, mb), len(steps))


@pytest.mark.parametrize("schedule, pp, v, m", LAYOUTS)
def test_transfers_complete_under_gloo_and_nccl_rules(schedule, pp, v, m):
    _, rank_plans = plans(schedule, pp, v, m)
    run_transfers(rank_plans, nccl=False)
    run_transfers(rank_plans, nccl=True)
    run_transfers(rank_plans, nccl=True, send_lag=1)   # even waiting for last round's sends

    forward_only = plan_transfers([[s for s in p.steps if s.kind == "F"] for p in rank_plans], pp, v,
                                  placement_of(schedule))
    run_transfers(forward_only, nccl=True)


def test_receives_are_posted_ahead_of_their_step():
    # ZB-V shares the link 0 -> 1 between chunk 0's activations and chunk 1's gradients and consumes them in
    # another order than they are produced: some arrive rounds before their step, over the compute of others.
    for schedule, v in (("zbv", 2), ("zero-bubble", 2), ("zero-bubble", 1)):
        _, rank_plans = plans(schedule, 2, v, 4)
        ahead = 0
        for p in rank_plans:
            for i, round_ in enumerate(p.rounds):
                for _, message in round_.receives:
                    consumer = next(j for j in range(i, len(p.rounds)) if p.rounds[j].step is not None
                                    and p.messages(p.rounds[j].step)[0] == message)
                    ahead += any(p.rounds[k].step is not None for k in range(i, consumer))
        assert ahead, schedule


@pytest.mark.parametrize("schedule, pp, v, m", [layout for layout in LAYOUTS if layout[3] >= layout[1]])
def test_unit_cost_bubble_matches_the_papers(schedule, pp, v, m):
    steps, _ = plans(schedule, pp, v, m)
    timeline = simulate(steps, pp, v, placement_of(schedule))
    expected = {"1f1b": (pp - 1) / (v * m), "zero-bubble": (pp - 1) / (3 * v * m), "zbv": (pp - 1) / (6 * m)}
    assert timeline.bubble == pytest.approx(expected[schedule], abs=1e-12)
    assert bubble_formula(schedule, pp, m, v) == pytest.approx(expected[schedule])
    assert schedule_bubble(schedule, pp, m, v) == pytest.approx(expected[schedule])


def test_bubble_is_simulated_below_pp_micro_batches():
    assert schedule_bubble("zero-bubble", 4, 2) == pytest.approx(
        simulate([build_schedule(4, r, 2, 1, "zero-bubble") for r in range(4)], 4, 1).bubble)
    assert schedule_bubble("zero-bubble", 4, 2) > bubble_formula("zero-bubble", 4, 2)


@pytest.mark.parametrize("schedule, pp, v, m", [layout for layout in LAYOUTS if layout[0] != "1f1b"])
def test_zero_bubble_holds_no_more_than_one_f_one_b(schedule, pp, v, m):
    ours = [peak_in_flight(build_schedule(pp, r, m, v, schedule)) for r in range(pp)]
    if schedule == "zbv":   # chunk-micro-batches of half a stage: 2 PP of them are 1F1B's PP micro-batches
        assert max(ours) <= 2 * min(pp, m)
        return
    theirs = [peak_in_flight(build_schedule(pp, r, m, v, "1f1b")) for r in range(pp)]
    assert max(ours) <= max(theirs)
    assert ours == [min(pp, m) * v] * pp or v > 1   # ZB-H1: every rank holds what rank 0 holds in 1F1B


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 12)])
def test_one_f_one_b_holds_at_most_pp_micro_batches(pp, m):
    peaks = [peak_in_flight(build_schedule(pp, r, m)) for r in range(pp)]
    assert peaks[0] == pp
    assert peaks == [pp - r for r in range(pp)]    # later stages hold fewer


def test_fewer_micro_batches_than_stages_still_completes():
    assert peak_in_flight(build_schedule(4, 0, 2)) == 2
    run_transfers(plans("1f1b", 4, 1, 2)[1], nccl=True)


def test_no_pipelining_alternates():
    for schedule in SCHEDULES:
        assert [(s.kind, s.micro_batch) for s in build_schedule(1, 0, 3, schedule=schedule)] == [
            ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_interleaved_needs_multiple_of_pp():
    with pytest.raises(ValueError, match="multiple of pipeline-model-parallel-size 4"):
        interleaved_one_f_one_b(4, 0, 6, 2)
    with pytest.raises(ValueError, match="multiple of pipeline-model-parallel-size 4"):
        build_schedule(4, 0, 6, 2, "zero-bubble")
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        build_schedule(4, 0, 6, 3, "zbv")


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


def test_chunks_in_a_v():
    # PP=2, 8 layers: chunk 0 goes down the ranks, chunk 1 back up; rank 0 holds the embedding and the loss.
    rank0, rank1 = chunks_of_rank(8, 2, 2, 0, "v-shape"), chunks_of_rank(8, 2, 2, 1, "v-shape")
    assert [(c.first_layer, c.num_layers) for c in rank0] == [(0, 2), (6, 2)]
    assert [(c.first_layer, c.num_layers) for c in rank1] == [(2, 2), (4, 2)]
    assert rank0[0].is_first and rank0[1].is_last and not any(c.is_first or c.is_last for c in rank1)
    for pp in (2, 4):
        stages = sorted(virtual_stage(r, c, pp, "v-shape") for r in range(pp) for c in range(2))
        assert stages == list(range(2 * pp))
        assert all(stage_rank(virtual_stage(r, c, pp, "v-shape"), pp, "v-shape") == r
                   for r in range(pp) for c in range(2))
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        chunks_of_rank(12, 2, 3, 0, "v-shape")
