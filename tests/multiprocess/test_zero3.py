"""ZeRO-3 (--zero-stage 3, FSDP2) against the single-process run, its memory per rank, and checkpoint interchange
with the other stages.

- Equivalence (fp32, 10 iterations, micro-batch 1 so gradients accumulate over micro-batches): DP=4, TP=2 x DP=2
  (with sequence parallelism and a Llama-style model: RMSNorm, SwiGLU, grouped-query attention, rotary), DP=4 as
  2 HSDP instances x 2 (sharded over 2 ranks, replicated over the 2 instances), DP=4 with
  parameter and optimizer offload, DP=4 with full recompute, PP=2 x DP=2 (1F1B, the tied embedding summed across
  stages) and PP=2 (V=2) x DP=2 (interleaved); in the 8-rank launch TP=2 x PP=2 x DP=2: losses, gradient norms
  and weights within 1e-5.
- Memory: at DP=4 each rank holds one row shard of every parameter, gradient and Adam state; the shards of the four
  ranks add up to the unsharded bytes exactly, and the largest rank holds at most 1/DP of them plus row rounding.
- Mixed precision: bf16 and fp16 (dynamic loss scaling) at stage 3 follow stage 1 of the same precision.
- Checkpoints: saved at stage 3, resumed at stage 1 (plain, and HSDP: 2 instances x 2) and in one process without
  sharding; saved at stage 1 under HSDP, resumed at stage 3; each continuation equals the uninterrupted run within
  1e-5.
- DeepSpeed's ZeRO-3 offload example config, read through the command line, equals the single-process run.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config.cli import parse_command_line
from megalite.config import validate
from megalite.training import Trainer

from ..helpers import losses, max_relative_difference, single_layout, tiny_config, with_checkpoint
from .groups import layout, requires_world
from .equivalence import CPU, RTOL, check_against_reference

ZERO3 = {"zero_stage": 3}
LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "group_query_attention": True,
         "num_query_groups": 2, "disable_bias_linear": True}


@pytest.mark.parametrize("label, tp, options, model, parallel", [
    ("ZeRO-3 DP=4", 1, {}, {}, {}),
    ("ZeRO-3 TP=2 x DP=2, sequence parallel, Llama-style", 2, {}, LLAMA, {"sequence_parallel": True}),
    ("ZeRO-3 DP=4, parameters and optimizer offloaded", 1, {"optimizer_cpu_offload": True, "offload_params": True},
     {}, {}),
    ("ZeRO-3 DP=4, full recompute", 1, {}, {"recompute_granularity": "full", "recompute_method": "uniform"}, {}),
    ("ZeRO-3 PP=2 x DP=2, tied embedding across stages", 1, {}, {"num_layers": 4}, {"pipeline_model_parallel_size": 2}),
    ("ZeRO-3 PP=2 (V=2) x DP=2, interleaved", 1, {}, {"num_layers": 4},
     {"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2}),
    ("ZeRO-3 DP=4 as 2 instances x 2 (HSDP)", 1, {}, {}, {"num_distributed_optimizer_instances": 2}),
])
def test_matches_single_process(label, tp, options, model, parallel):
    cfg = tiny_config(tp=tp, optimizer={**ZERO3, **options}, model=model, parallel=parallel,
                      training={"micro_batch_size": 1})
    check_against_reference(cfg, None, label)


@requires_world(8)
def test_three_dimensional_layout_matches_single_process():
    cfg = tiny_config(tp=2, pp=2, optimizer=ZERO3, model={"num_layers": 4}, training={"micro_batch_size": 1})
    check_against_reference(cfg, None, "ZeRO-3 TP=2 x PP=2 x DP=2")


def _bytes(trainer: Trainer) -> torch.Tensor:
    """(parameter, gradient, Adam state) bytes this rank holds."""
    params, grads = trainer.engine.held_bytes()
    return torch.tensor([params, grads, trainer.optimizer.state_bytes()], dtype=torch.float64)


def test_bytes_per_rank_are_one_over_dp():
    cfg = tiny_config(training={"train_iters": 1}, data={"eval_interval": 0})
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, CPU)
        trainer.train()
        unsharded = _bytes(trainer)
    with layout(1, 1):
        trainer = Trainer.on_registered_layout(dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, **ZERO3)), CPU)
        trainer.train()
        mine = _bytes(trainer)
        # Rows are cut ceil(rows / DP) at a time: the most a rank can hold.
        dp = parallel_state.get_data_parallel_world_size()
        bound = sum(-(-p.shape[0] // dp) * (p.numel() // p.shape[0]) * 4 for p in trainer.engine.params)
    total, largest = mine.clone(), mine.clone()
    dist.all_reduce(total)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    ratios = (largest / unsharded).tolist()
    print(f"ZeRO-3 DP={dp} bytes of the largest rank / unsharded: parameters {ratios[0]:.4f}, gradients "
          f"{ratios[1]:.4f}, Adam states {ratios[2]:.4f}")
    assert total.tolist() == unsharded.tolist()    # the shards tile the model exactly
    assert largest.tolist() <= [bound, bound, 2 * bound]


@pytest.mark.parametrize("precision, tolerance", [("bf16", 2e-4), ("fp16", 1e-4)])
def test_mixed_precision_follows_stage_one(precision, tolerance):
    # A starting loss scale of 2^12 overflows for a few steps only, so most steps are taken.
    cfg = tiny_config(training={precision: True}, data={"eval_interval": 0}, optimizer={"initial_loss_scale": 4096.0})
    runs = {}
    for stage, optimizer in [(1, {"use_distributed_optimizer": True}), (3, ZERO3)]:
        with layout(1, 1):
            runs[stage] = Trainer.on_registered_layout(dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, **optimizer)),
                                  CPU).train()
    difference = max_relative_difference(losses(runs[3]), losses(runs[1]))
    print(f"{precision}: ZeRO-3 vs ZeRO-1 at DP=4, max rel loss diff {difference:.1e}")
    assert difference < tolerance
    assert sum(not r.get("skipped", False) for r in runs[3]) >= 5
    assert [r.get("loss_scale") for r in runs[3]] == [r.get("loss_scale") for r in runs[1]]


def test_checkpoints_move_between_stages(directory):
    cfg = tiny_config(optimizer={"adam_eps": 1e-5}, data={"eval_interval": 0})   # adam_eps: see equivalence.py
    stage1 = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, use_distributed_optimizer=True))
    stage3 = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, **ZERO3))
    # HSDP: the ZeRO-1 run is DP=4 as 2 instances x 2 (each Adam state sharded over 2 ranks, replicated twice).
    hsdp = dataclasses.replace(stage1, parallel=dataclasses.replace(stage1.parallel,
                                                                    num_distributed_optimizer_instances=2))
    with layout(1, 1, instances=2):
        straight = losses(Trainer.on_registered_layout(with_checkpoint(hsdp, save=f"{directory}/s1", save_interval=5), CPU).train())
    with layout(1, 1):
        zero3 = losses(Trainer.on_registered_layout(with_checkpoint(stage3, save=f"{directory}/s3", save_interval=5), CPU).train())
    assert max_relative_difference(zero3, straight) < RTOL
    for label, run_cfg, saved, ranks in [
        ("saved at ZeRO-3, resumed at ZeRO-1", stage1, "s3", None),
        ("saved at ZeRO-3, resumed at ZeRO-1 as 2 instances x 2 (HSDP)", hsdp, "s3", None),
        ("saved at ZeRO-3, resumed in one process, unsharded", cfg, "s3", [0]),
        ("saved at ZeRO-1 as 2 instances x 2 (HSDP), resumed at ZeRO-3", stage3, "s1", None),
    ]:
        instances = run_cfg.parallel.num_distributed_optimizer_instances
        with layout(1, 1, ranks=ranks, instances=instances) as member:
            if not member:
                continue
            trainer = Trainer.on_registered_layout(with_checkpoint(run_cfg, load=f"{directory}/{saved}/iter_0000005"), CPU)
            assert trainer.state.iteration == 5
            resumed = losses(trainer.train())
        difference = max_relative_difference(resumed, straight[5:])
        print(f"{label} (DP=4, after 5 of 10 iterations): max rel loss diff {difference:.1e}")
        assert difference < RTOL


def test_deepspeed_zero3_offload_example_config(directory):
    """DeepSpeed's common ZeRO-3 offload example, through the command line, equals the single-process run."""
    path = f"{directory}/ds_config.json"
    if dist.get_rank() == 0:
        with open(path, "w") as file:
            json.dump({"train_batch_size": 32, "zero_optimization": {
                "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}, file)
    dist.barrier()
    command_line = parse_command_line(
        ["--deepspeed-config", path, "model=gpt_tiny", "data=mock", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "301", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--train-iters", "10", "--eval-interval", "5", "--eval-iters", "2",
         "--lr", "1e-3"], world_size=4)
    cfg = command_line.config
    validate(cfg, 4)
    o, t = cfg.optimizer, cfg.training
    assert (o.zero_stage, o.optimizer_cpu_offload, o.offload_params) == (3, True, True)
    assert (t.global_batch_size, t.micro_batch_size) == (32, 8)   # DeepSpeed's rule: micro = 32 / DP, no accumulation
    assert any(line.split()[:4] == ["zero_optimization.stage", "3", "mapped", "--zero-stage"]
               for line in command_line.deepspeed_settings())
    check_against_reference(cfg, None, "DeepSpeed ZeRO-3 offload example at DP=4")
