"""The data-parallel engine and the distributed optimizer against the single-process run, state sharding, and the
fp16 loss scaler's all-ranks-skip rule.

Small buckets (4,000 elements) make several buckets per model so bucket boundaries, padding and overlap are
exercised; micro-batch size 1 makes several micro-batches, so gradients accumulate before any reduction.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.distributed import data_parallel
from megalite.planner import Layout, model_state_bytes
from megalite.training import Trainer
from megalite.training.hooks import StepHook

from ..data.helpers import write_progressions
from ..helpers import tiny_config
from .groups import layout
from .equivalence import CPU, check_against_reference

BUCKET = 4000
DIST = {"use_distributed_optimizer": True}
MUON = {"optimizer": "muon"}
HSDP = {"instances": 2}   # --num-distributed-optimizer-instances (a ParallelConfig field)


@pytest.mark.parametrize("label, tp, pp, ranks, options", [
    ("DP=2 all-reduce", 1, 1, [0, 1], {}),
    ("DP=4 all-reduce overlapped", 1, 1, None, {"overlap_grad_reduce": True}),
    ("DP=2 ZeRO-1", 1, 1, [0, 1], DIST),
    ("DP=4 ZeRO-1 overlapped", 1, 1, None, {**DIST, "overlap_grad_reduce": True, "overlap_param_gather": True}),
    ("DP=4 ZeRO-2", 1, 1, None, {**DIST, "zero_stage": 2}),
    ("DP=2 ZeRO-2 overlapped", 1, 1, [0, 1], {**DIST, "zero_stage": 2, "overlap_grad_reduce": True,
                                              "overlap_param_gather": True}),
    ("TP=2 x DP=2 ZeRO-1", 2, 1, None, {**DIST, "overlap_grad_reduce": True}),
    ("PP=2 x DP=2 ZeRO-2 (tied embedding across stages)", 1, 2, None, {**DIST, "zero_stage": 2,
                                                                        "overlap_grad_reduce": True}),
    ("DP=2 ZeRO-1 CPU offload", 1, 1, [0, 1], {**DIST, "optimizer_cpu_offload": True}),
    ("TP=2 Muon duplicated", 2, 1, [0, 1], MUON),
    ("TP=2 x DP=2 ZeRO-1 Muon distributed, matrices layer-wise over DP", 2, 1, None,
     {**DIST, **MUON, "muon_tp_mode": "distributed"}),
    ("PP=2 x DP=2 ZeRO-2 Muon", 1, 2, None, {**DIST, **MUON, "zero_stage": 2}),
    ("DP=2 ZeRO-3 Muon, matrices layer-wise over the FSDP2 shards", 1, 1, [0, 1], {**MUON, "zero_stage": 3}),
    ("TP=2 x DP=2 ZeRO-3 Muon duplicated", 2, 1, None, {**MUON, "zero_stage": 3}),
    ("TP=2 x DP=2 ZeRO-3 Muon distributed", 2, 1, None, {**MUON, "zero_stage": 3, "muon_tp_mode": "distributed"}),
    ("DP=4 as 2 instances x 2 (HSDP) ZeRO-1 overlapped", 1, 1, None,
     {**DIST, **HSDP, "overlap_grad_reduce": True, "overlap_param_gather": True}),
])
def test_matches_single_process(label, tp, pp, ranks, options):
    options = dict(options)
    parallel = {"num_distributed_optimizer_instances": options.pop("instances", 1)}
    cfg = tiny_config(tp=tp, pp=pp, optimizer={"ddp_bucket_size": BUCKET, **options}, parallel=parallel,
                      training={"micro_batch_size": 1})
    check_against_reference(cfg, ranks, label)


def _state_bytes(cfg) -> int:
    trainer = Trainer.on_registered_layout(cfg, CPU)
    trainer.train()     # Adam states exist after the first step
    return trainer.optimizer.state_bytes(), len(trainer.engine.buckets)


def test_optimizer_state_bytes_are_one_over_dp():
    """And with HSDP (DP=4 as 2 instances x 2) one over the instance's 2 ranks, as the planner predicts."""
    cfg = tiny_config(optimizer={"ddp_bucket_size": BUCKET, **DIST}, training={"train_iters": 1})
    with layout(1, 1, ranks=[torch.distributed.get_rank()]):
        unsharded, _ = _state_bytes(cfg)
    with layout(1, 1):
        sharded, buckets = _state_bytes(cfg)
    dp = parallel_state_world = torch.distributed.get_world_size()
    # Each bucket is padded to a multiple of DP x 16 elements: at most that much more, per state tensor kind.
    padding_bytes = buckets * dp * 16 * 4 * 2
    print(f"Adam state bytes: unsharded {unsharded}, DP={parallel_state_world} shard {sharded} "
          f"(ratio {sharded / unsharded:.4f})")
    assert unsharded / dp <= sharded + 1 and sharded * dp <= unsharded + padding_bytes
    hsdp = Layout(dp=dp, zero=1, instances=2)
    with layout(1, 1, instances=2):
        instance_rank = parallel_state.get_intra_distributed_optimizer_instance_group().rank
        held, _ = _state_bytes(dataclasses.replace(cfg, parallel=hsdp.apply(cfg).parallel))
    planned = model_state_bytes(cfg.model, hsdp, dtype_bytes=4, dp_rank=instance_rank, bucket_size=BUCKET).optimizer
    print(f"HSDP DP={dp} as 2 x {dp // 2}: Adam state bytes {held} (x unsharded {held / unsharded:.4f}), planned "
          f"{planned:.0f} (measured / planned {held / planned:.4f})")
    assert held == planned and unsharded / (dp // 2) <= held <= unsharded / (dp // 2) + padding_bytes


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    cfg = tiny_config(optimizer={**DIST, "initial_loss_scale": 1024.0, "min_loss_scale": 256.0, "hysteresis": 1,
                                 "loss_scale_window": 2},
                      training={"fp16": True, "micro_batch_size": 1, "train_iters": 8})
    with layout(1, 1):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        inject_at = {2, 5, 6}   # iterations whose gradients get an inf on DP rank 1's own shard only

        class OverflowAfterSync(StepHook):
            def after_grad_sync(self):
                if trainer.state.iteration + 1 in inject_at and parallel_state.get_data_parallel_rank() == 1:
                    trainer.optimizer.pieces[0].grad[0] = float("inf")
                return {}

        trainer.hooks.insert(0, OverflowAfterSync())
        records, weights = [], []
        for _ in range(cfg.training.train_iters):
            before = trainer.engine.param_buffer.clone()
            records.append(trainer.train_step())
            weights.append(torch.equal(before, trainer.engine.param_buffer))
    skipped = [r["iteration"] for r in records if r.get("skipped")]
    scales = [r["loss_scale"] for r in records]
    assert skipped == [2, 5, 6]                       # on every rank, although only rank 1 overflowed
    assert [weights[i - 1] for i in skipped] == [True] * 3 and not any(
        weights[i - 1] for i in range(1, 9) if i not in skipped)
    # 1024 -> overflow halves to 512 -> two clean steps (3, 4) double it back -> two overflows: 512, then the
    # minimum 256 holds -> clean steps 7, 8.
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 1024.0, 512.0, 256.0, 256.0]


def test_no_blocking_data_parallel_collective_stands_between_the_gathers_and_the_forward(directory, monkeypatch):
    """--overlap-param-gather: from a step's gather launches to the next forward's first wait, nothing on the DP
    group is waited for at once (the loss all-reduce, the --eod-mask-loss token count), which on a GPU would queue
    behind every gather and hold the next forward until they all land. Recorded over a real DP=4 run."""
    prefix = Path(directory) / "progressions"
    if dist.get_rank() == 0:
        write_progressions(prefix, 200, 301)
    dist.barrier()
    cfg = tiny_config(optimizer={"ddp_bucket_size": BUCKET, **DIST, "overlap_grad_reduce": True,
                                 "overlap_param_gather": True},
                      data={"mock_data": False, "data_path": str(prefix), "tokenizer_type": "NullTokenizer",
                            "eod_mask_loss": True, "eval_interval": 0},
                      training={"micro_batch_size": 1, "train_iters": 3})
    events = []
    gather, all_reduce = data_parallel._all_gather, dist.all_reduce

    class Recorded:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("gather wait")
            return self.work.wait()

    def recorded_gather(*args, **kwargs):
        events.append("gather launch")
        return Recorded(gather(*args, **kwargs))

    def recorded_all_reduce(tensor, *args, group=None, async_op=False, **kwargs):
        if group is parallel_state.get_data_parallel_group(with_context_parallel=True).group:
            events.append("DP all-reduce, " + ("waited later" if async_op else "waited at once"))
        return all_reduce(tensor, *args, group=group, async_op=async_op, **kwargs)

    monkeypatch.setattr(data_parallel, "_all_gather", recorded_gather)
    monkeypatch.setattr(dist, "all_reduce", recorded_all_reduce)
    with layout(1, 1):
        Trainer.on_registered_layout(cfg, CPU).train()
    in_flight, between = False, []   # what happens from a step's gather launches to the first wait on one
    for event in events:
        in_flight = event == "gather launch" or (in_flight and event != "gather wait")
        if in_flight and event.startswith("DP"):
            between.append(event)
    assert "DP all-reduce, waited at once" not in between, events
    assert "DP all-reduce, waited later" in events   # the token count, launched there
