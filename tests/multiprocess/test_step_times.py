"""Per-step pipeline times (``--timing-log-level 2``): a PP=4 run writes, for each logged iteration, every rank's
steps in its schedule's order, their times increasing, on one clock: a forward starts after the previous stage's
forward of its micro-batch ended, a backward after the next stage's backward (the ranks share a machine, so the
wall clock that aligns them is one clock). The timeline of such a record reads back with its bubble. A ZB-V run on
part of the world records its W steps in the v-shape's order, and its timers reduce over its own ranks."""

from __future__ import annotations

import json

import torch.distributed as dist

from megalite.pipeline.schedules import build_schedule
from megalite.training import Trainer
from megalite.training.step_times import steps_file
from megalite.visual.timeline import from_recorded

from ..helpers import tiny_config
from .equivalence import CPU
from .groups import layout

CLOCK_SLACK_MS = 2.0   # what reading two clocks one after the other may cost on a loaded machine


def test_a_pipelined_run_records_every_step_on_one_clock(directory):
    metrics = f"{directory}/metrics.jsonl"
    cfg = tiny_config(pp=4, model={"num_layers": 4}, data={"eval_interval": 0},
                      training={"micro_batch_size": 1, "global_batch_size": 6, "train_iters": 3},
                      logging={"log_interval": 2, "timing_log_level": 2, "metrics_file": metrics})
    with layout(1, 4):
        Trainer.on_registered_layout(cfg, CPU).train()
    dist.barrier()
    if dist.get_rank() != 0:
        return
    records = [json.loads(line) for line in steps_file(metrics).read_text().splitlines()]
    assert [r["iteration"] for r in records] == [2, 3]   # the logged ones: every 2nd, and the last
    for record in records:
        assert (record["pipeline_model_parallel_size"], record["num_micro_batches"]) == (4, 6)
        ends: dict[tuple[str, int, int], float] = {}
        for rank, steps in enumerate(record["ranks"]):
            assert [tuple(s[:3]) for s in steps] == [(s.kind, s.chunk, s.micro_batch)
                                                     for s in build_schedule(4, rank, 6)]
            times = [t for s in steps for t in s[3:]]
            assert times == sorted(times) and times[0] >= 0
            ends.update({(s[0], rank, s[2]): s[4] for s in steps})
        for rank, steps in enumerate(record["ranks"]):
            for kind, _, micro_batch, start, _ in steps:
                before = (kind, rank - 1 if kind == "F" else rank + 1, micro_batch)
                if before in ends:
                    assert start >= ends[before] - CLOCK_SLACK_MS, (record["iteration"], rank, kind, micro_batch)
        timeline = from_recorded(record)
        assert len(timeline.ranks) == 4 and timeline.bubble > 0


def test_a_zbv_run_on_part_of_the_world_records_its_steps_and_timers(directory):
    """ZB-V at PP=2 on ranks 0-1 while ranks 2-3 wait at a barrier: the timers' min and max are reduced over the
    layout's ranks (over the world they would wait for ranks 2-3 until the collective timed out)."""
    metrics = f"{directory}/zbv.jsonl"
    cfg = tiny_config(pp=2, model={"num_layers": 4}, parallel={"pipeline_schedule": "zbv"}, data={"eval_interval": 0},
                      training={"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 2},
                      logging={"log_interval": 1, "timing_log_level": 2, "metrics_file": metrics})
    records = []
    with layout(1, 2, ranks=[0, 1]) as member:
        if member:
            records = [r for r in Trainer.on_registered_layout(cfg, CPU).train() if "loss" in r]
    dist.barrier()
    if dist.get_rank() != 0:
        return
    assert len(records) == 2 and all(r["time_forward_backward_ms_min"] <= r["time_forward_backward_ms_max"]
                                     for r in records)
    recorded = [json.loads(line) for line in steps_file(metrics).read_text().splitlines()]
    assert [r["schedule"] for r in recorded] == ["zbv", "zbv"]
    for rank, steps in enumerate(recorded[-1]["ranks"]):
        assert [tuple(s[:3]) for s in steps] == [(s.kind, s.chunk, s.micro_batch)
                                                 for s in build_schedule(2, rank, 4, 2, "zbv")]
    assert any(s[0] == "W" for s in recorded[-1]["ranks"][0]) and from_recorded(recorded[-1]).bubble >= 0
