"""DeepSpeed configs in the shapes people use (tests/config/deepspeed_configs/) train at DP=2 with the mapping
expected, and the knobs that only tune speed or memory leave the losses alone.

Each file is read through the command line as pretrain_gpt.py reads it (a tiny GPT of 4 layers beside it, 2
iterations), on a layout of ranks 0 and 1 (data-parallel size 2). The same file without its speed and memory knobs
(every key the table lists as ignored, and the mapped ones that set only bucket sizes, overlap, prefetching, recompute
or logging) must give a configuration that differs in those settings only, and the same losses and gradient norms:
tolerance 1e-6 relative (measured: 0, the same floating-point operations in the same order).
How each key is read is tests/config/test_deepspeed.py; the ZeRO-Infinity (NVMe) file is refused there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist

from megalite.config import flags, validate
from megalite.config.cli import parse_command_line
from megalite.config.deepspeed import IGNORED, MAPPED
from megalite.training import Trainer

from ..helpers import NO_DROPOUT, TINY, losses, max_relative_difference
from .equivalence import CPU
from .groups import layout

CONFIGS = Path(__file__).resolve().parents[1] / "config" / "deepspeed_configs"
# (--timing-log-level 0: the timers take their min/max over the world, and ranks 2 and 3 do not train here)
ARGV = [*TINY, *NO_DROPOUT, "--num-layers", "4", "--vocab-size", "301", "--train-iters", "2", "--log-interval", "1",
        "--timing-log-level", "0"]
DP = 2
# Settings that change how fast a step runs, or how much memory it needs, never what it computes.
SPEED_SETTINGS = {"optimizer.overlap_grad_reduce", "optimizer.ddp_bucket_size", "optimizer.zero3_prefetch_bucket_size",
                  "model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers",
                  "logging.log_interval", "logging.timing_log_level", "logging.tensorboard_dir"}


def _parse(path: Path, *argv: str):
    return parse_command_line(["--deepspeed-config", str(path), *ARGV, *argv], world_size=DP)


def _without_speed_knobs(command_line, path: Path, directory: str) -> Path:
    """The file without the keys the table says only tune speed or memory (each rank writes its own copy)."""
    data = json.loads(path.read_text())
    for row in command_line.deepspeed.rows:
        speed_only = row.status == IGNORED or (row.status == MAPPED and row.settings
                                               and {key for key, _ in row.settings} <= SPEED_SETTINGS)
        if speed_only and not row.key.startswith("fp16."):   # fp16's scaler keys are ignored only while it is off
            *parents, name = row.key.split(".")
            node = data
            for parent in parents:
                node = node.get(parent, {})   # a block removed already takes its keys with it
            node.pop(name, None)
    stripped = Path(directory) / f"stripped-{dist.get_rank()}-{path.name}"
    stripped.write_text(json.dumps(data))
    return stripped


def _train(cfg) -> list[float]:
    """The losses and gradient norms of each iteration (Adam hides a gradient's scale from the next loss)."""
    with layout(1, 1, ranks=list(range(DP))) as member:
        records = Trainer.on_registered_layout(cfg, CPU).train() if member else []
    return losses(records) + [r["grad_norm"] for r in records if "grad_norm" in r]


# name -> the settings its mapping must give at DP=2 (beside the tiny model on the command line)
EXPECTED = {
    "megatron_gpt_zero2.json": {   # ZeRO-2, buckets and overlap, activation checkpointing: full recompute
        "optimizer.zero_level": 2, "optimizer.ddp_bucket_size": 50_000_000, "optimizer.overlap_grad_reduce": True,
        "model.recompute_granularity": "full", "model.recompute_method": "uniform",
        "parallel.sequence_parallel": False, "training.global_batch_size": 16, "training.micro_batch_size": 2,
        "optimizer.clip_grad": 1.0},
    "zero2_cpu_offload.json": {   # the optimizer on the CPU, AdamW and WarmupDecayLR
        "optimizer.zero_level": 2, "optimizer.optimizer_cpu_offload": True, "optimizer.ddp_bucket_size": 200_000_000,
        "optimizer.lr": 1e-3, "optimizer.adam_beta2": 0.95, "optimizer.weight_decay": 0.1,
        "optimizer.lr_warmup_iters": 2, "optimizer.lr_decay_style": "linear", "optimizer.lr_decay_iters": 10,
        "training.global_batch_size": 8, "training.micro_batch_size": 2},
    "zero3.json": {   # FSDP2, prefetching the next layers that fit in 5e7 elements
        "optimizer.zero_level": 3, "optimizer.zero3_prefetch_bucket_size": 50_000_000,
        "optimizer.overlap_grad_reduce": False, "optimizer.ddp_bucket_size": None,
        "training.global_batch_size": 8, "training.micro_batch_size": 2, "optimizer.weight_decay": 0.0},
    "hf_trainer_zero2_auto.json": {   # "auto" everywhere: megalite's values (and the command line's micro-batch)
        "optimizer.zero_level": 2, "optimizer.overlap_grad_reduce": True, "optimizer.ddp_bucket_size": None,
        "optimizer.optimizer_cpu_offload": False, "training.bf16": False, "training.fp16": False,
        "training.micro_batch_size": 1, "training.global_batch_size": 8, "logging.log_interval": 1},
    "zero3_offload_finetune.json": {   # ZeRO-3, parameters and optimizer on the CPU, "auto" sizes
        "optimizer.zero_level": 3, "optimizer.optimizer_cpu_offload": True, "optimizer.offload_params": True,
        "optimizer.zero3_prefetch_bucket_size": None, "optimizer.clip_grad": 1.0},
    "legacy_spellings.json": {   # cpu_offload, cpu_offload_param, prefetch_bucket_size, bfloat16
        "optimizer.zero_level": 3, "optimizer.optimizer_cpu_offload": True, "optimizer.offload_params": True,
        "optimizer.zero3_prefetch_bucket_size": 100_000, "training.bf16": False},
}


def _read(name: str, directory: str):
    """The file's run and the run without its speed knobs, checked: (cfg, cfg without them, the settings that
    differ)."""
    path = CONFIGS / name
    argv = ["--micro-batch-size", "1"] if name == "hf_trainer_zero2_auto.json" else []
    command_line = _parse(path, *argv)
    cfg = command_line.config
    validate(cfg, DP)
    got = {key: (cfg.optimizer.zero_level if key == "optimizer.zero_level" else flags.get(cfg, key))
           for key in EXPECTED[name]}
    assert got == EXPECTED[name]
    if name == "zero3.json":   # its wall_clock_breakdown, which the command line turns off here
        assert command_line.deepspeed.settings()["logging.timing_log_level"] == 1
    plain = _parse(_without_speed_knobs(command_line, path, directory), *argv).config
    differences = set(flags.differences(cfg, plain)) - {"training.deepspeed_config"}
    assert differences <= SPEED_SETTINGS, differences - SPEED_SETTINGS
    return cfg, plain, differences


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_people_s_config_trains_at_dp2_and_its_speed_knobs_change_nothing(name, directory):
    # Ranks 0 and 1 read the file (ranks 2 and 3 only take part in building the layouts); a failure to read it is
    # raised after rank 0 has told the others, so that none waits in a collective for it.
    member, read, error = dist.get_rank() < DP, None, None
    if member:
        try:
            read = _read(name, directory)
        except Exception as raised:   # noqa: BLE001 - re-raised below
            error = raised
    plan = [error is None, read is not None and bool(read[2] - {"logging.log_interval", "logging.timing_log_level"})]
    dist.broadcast_object_list(plan, src=0)
    ok, compare = plan
    if error is not None:
        raise error
    if not ok:
        return   # rank 0 failed: it reports why
    cfg, plain, differences = read if member else (None, None, set())
    runs = [_train(cfg)] + ([_train(plain)] if compare else [])   # every rank builds each layout
    if not member:
        return
    assert len(runs[0]) == 4 and all(math.isfinite(value) for value in runs[0])   # 2 losses, 2 gradient norms
    if compare:
        difference = max_relative_difference(runs[0], runs[1])
        print(f"{name}: DP=2, with its speed knobs ({', '.join(sorted(differences))}) and without: max rel "
              f"difference of the losses and gradient norms {difference:.1e}")
        assert difference < 1e-6
