"""The out-of-memory doctor, driven by simulated out-of-memory errors, and ``pretrain_gpt.py --dry-run``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megalite.config.cli import parse_args
from megalite.planner import Layout, diagnose_out_of_memory, is_out_of_memory, stage_memory
from megalite.planner.doctor import device_memory_bytes
from megalite.planner.dry_run import numerics_for
from megalite.training.trainer import Trainer

MiB = 2**20
ARGV = ["model=gpt_tiny", "data=mock", "--train-iters", "1", "--micro-batch-size", "8", "--global-batch-size", "8",
        "--seq-length", "256"]


def _memory(argv, world_size=1):
    cfg = parse_args(argv)
    return cfg, stage_memory(cfg.model, Layout.from_config(cfg, world_size), 0, cfg.training.global_batch_size,
                             dtype_bytes=4, numerics=numerics_for(cfg, cuda=False))


def _cuda_error(capacity_bytes: float) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
                                  f"{capacity_bytes / MiB:.2f} MiB of which 1.00 MiB is free.")


def _causes(argv):
    """Device sizes where the states alone, the activations, and nothing in the estimate run over."""
    cfg, mem = _memory(argv)
    return cfg, mem, {"states": mem.states * 0.8, "activations": (mem.states + mem.activations / 2) / 0.9,
                      "fits": mem.total / 0.8}


def test_recognizes_out_of_memory_errors():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried... out of memory"))
    assert not is_out_of_memory(RuntimeError("a collective timed out"))
    # The CPU allocator's own words (Linux, Windows), which never say "out of memory", and Python's MemoryError.
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                                         "allocate memory: you tried to allocate 10000000000000 bytes. Error code 12 "
                                         "(Cannot allocate memory)"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB."))
    assert is_out_of_memory(MemoryError())
    assert device_memory_bytes(_cuda_error(80 * 1024 * MiB)) == 80 * 2**30


def test_names_the_cause_with_numbers():
    cfg, mem, device = _causes(ARGV)
    assert mem.activations > mem.states   # a long sequence and a big micro-batch: activations dominate
    states = diagnose_out_of_memory(cfg, _cuda_error(device["states"]), world_size=1, cuda=False)
    assert "the model states alone exceed the device" in states and "--optimizer-cpu-offload" in states
    assert "tensor or pipeline parallelism" in states and "The planner finds no layout of 1 GPUs" in states
    acts = diagnose_out_of_memory(cfg, _cuda_error(device["activations"]), world_size=1, cuda=False)
    assert "the activations do not fit" in acts and "--micro-batch-size 4" in acts
    assert "--recompute-granularity selective" in acts and "--recompute-granularity full" in acts
    assert f"{mem.activations / 2**20:.1f} MiB of activations" in acts and "The planner suggests" in acts
    fits = diagnose_out_of_memory(cfg, _cuda_error(device["fits"]), world_size=1, cuda=False)
    assert "although the estimate fits" in fits and "expandable_segments" in fits


def test_sequence_parallel_is_suggested_under_tensor_parallelism():
    cfg = parse_args(ARGV + ["--tensor-model-parallel-size", "2"])
    mem = stage_memory(cfg.model, Layout.from_config(cfg, 2), 0, 8, dtype_bytes=4,
                       numerics=numerics_for(cfg, cuda=False))
    message = diagnose_out_of_memory(cfg, _cuda_error((mem.states + mem.activations / 2) / 0.9), world_size=2,
                                     cuda=False, suggest=False)
    assert "--sequence-parallel" in message


@pytest.mark.parametrize("cause, expected", [("states", "the model states alone exceed the device"),
                                             ("activations", "the activations do not fit")])
def test_training_that_runs_out_of_memory_prints_the_diagnosis(monkeypatch, capsys, cause, expected):
    _, _, device = _causes(ARGV)

    def out_of_memory(self):
        raise _cuda_error(device[cause])

    monkeypatch.setattr(Trainer, "train", out_of_memory)
    assert pretrain_gpt.main(ARGV) == 1
    err = capsys.readouterr().err
    assert err.startswith("megalite: out of memory on rank 0") and expected in err
    assert len(err.strip().splitlines()) <= 4 and "Traceback" not in err


def test_a_cpu_allocator_error_is_diagnosed_too(monkeypatch, capsys):
    def out_of_memory(self):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 GiB. Out of memory.")

    monkeypatch.setattr(Trainer, "train", out_of_memory)
    assert pretrain_gpt.main(ARGV) == 1
    assert capsys.readouterr().err.startswith("megalite: out of memory on rank 0")


def test_dry_run_prints_the_estimate_and_trains_nothing(monkeypatch, capsys):
    monkeypatch.setattr(Trainer, "__init__", lambda *args: pytest.fail("--dry-run must not build the trainer"))
    assert pretrain_gpt.main(ARGV + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    _, mem = _memory(ARGV)
    assert "dry run: TP=1 x PP=1 x DP=1, micro-batch 8, DDP, 1 micro-batches per step" in out
    assert f"{mem.activations / 2**30:.3f}" in out and f"{mem.total / 2**30:.3f}" in out


def test_dry_run_of_a_pipeline_marks_the_most_loaded_stage(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ARGV + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--global-batch-size", "32",
                   "--optimizer", "muon", "--dry-run"]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "TP=1 x PP=2 x DP=2" in out and out.count("<- most loaded") == 1
    assert ("Muon (--muon-tp-mode duplicated, 5 Newton-Schulz steps, each matrix owned by one of the 2 data-parallel "
            "ranks): ") in out   # its FLOPs and bytes: tests/planner/test_performance.py
    assert "pipeline schedule 1f1b: bubble 50.0% of compute" in out     # (PP - 1) / M, M = 32 / (DP 2 x 8)
    assert pretrain_gpt.main(argv + ["--pipeline-schedule", "zbv", "--num-layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "V=2, zbv" in out and "pipeline schedule zbv: bubble 8.3% of compute" in out   # (PP - 1) / (6 M)
    assert "(1f1b at V=1: 50.0%)" in out


def _states_exceed(argv, world_size):
    """The diagnosis on a device 20% smaller than the model states (and gathered layers) of ``argv``."""
    cfg = parse_args(argv)
    mem = stage_memory(cfg.model, Layout.from_config(cfg, world_size), 0, cfg.training.global_batch_size,
                       dtype_bytes=4, numerics=numerics_for(cfg, cuda=False))
    return diagnose_out_of_memory(cfg, _cuda_error(mem.fixed * 0.8), world_size=world_size, cuda=False,
                                  suggest=False)


ZERO_ARGV = ["model=gpt_tiny", "data=mock", "--micro-batch-size", "1", "--global-batch-size", "8", "--num-layers", "8"]


def test_zero3_is_suggested_when_the_states_do_not_fit_and_there_is_no_pipeline():
    message = _states_exceed(ZERO_ARGV + ["--use-distributed-optimizer"], 4)
    assert "--zero-stage 2" in message and "--zero-stage 3 without --use-distributed-optimizer" in message
    assert "--zero-stage 3 (" in _states_exceed(ZERO_ARGV, 4)                        # from plain DP
    piped = _states_exceed(ZERO_ARGV + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], 4)
    assert "--zero-stage 2" in piped and "--zero-stage 3" not in piped               # FSDP2 does not compose with PP
    assert "--zero-stage 3" not in _states_exceed(ZERO_ARGV, 1)                      # nothing to shard over
    # Two layers: the gathered root unit and layers outweigh what ZeRO-3 shards, so it would not help.
    two_layers = _states_exceed(ZERO_ARGV[:-2] + ["--use-distributed-optimizer"], 4)
    assert "--zero-stage 2" in two_layers and "--zero-stage 3" not in two_layers


def test_at_zero3_the_doctor_counts_the_gathered_layers_and_suggests_offloading_the_parameters():
    message = _states_exceed(ZERO_ARGV + ["--zero-stage", "3"], 4)
    assert "gathered layers" in message and "--optimizer-cpu-offload --offload-params" in message
    assert "--zero-stage" not in message.split("Split or shard them:")[1]
    offloaded = _states_exceed(ZERO_ARGV + ["--zero-stage", "3", "--optimizer-cpu-offload"], 4)
    assert "--optimizer-cpu-offload --offload-params" in offloaded


def test_dry_run_of_context_parallelism_shows_the_tokens_per_gpu_and_the_ring(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ARGV + ["--context-parallel-size", "2", "--attention-dropout", "0", "--global-batch-size", "16", "--dry-run"]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "TP=1 x CP=2 (p2p) x PP=1 x DP=2" in out
    assert "each GPU holds 128 of the 256 tokens of every sample; its p2p attention sends" in out
    (_, whole), (_, split) = (_memory(words, world) for words, world in [(ARGV + ["--global-batch-size", "16"], 2),
                                                                         (argv, 4)])
    assert split.activations < 0.6 * whole.activations   # the same micro-batch of 8 samples, half their tokens


def test_dry_run_of_zero3_shows_the_gathered_layers_and_the_host_states(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ARGV + ["--global-batch-size", "32", "--zero-stage", "3", "--optimizer-cpu-offload", "--offload-params",
                   "--dry-run"]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3+offload+params" in out and "gathered" in out
    assert "of parameter, gradient and optimizer states on the host" in out


def test_dry_run_with_a_deepspeed_config_estimates_what_the_file_asks_for(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = Path(__file__).resolve().parents[1] / "config" / "deepspeed_configs" / "zero3.json"
    argv = ["model=gpt_tiny", "data=mock", "--num-layers", "4", "--deepspeed-config", str(config), "--dry-run"]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "deepspeed config " in out and "0 refused" in out   # the file's table, then the estimate it implies
    assert "dry run: TP=1 x PP=1 x DP=4, micro-batch 2, ZeRO-3, 1 micro-batches per step" in out   # 8 = 2 x 1 x 4
    cfg = parse_args(argv[:-1], world_size=4)
    prefetched = stage_memory(cfg.model, Layout.from_config(cfg, 4), 0, 8, dtype_bytes=4, numerics=numerics_for(
        cfg, cuda=False), prefetch_bucket_size=cfg.optimizer.zero3_prefetch_bucket_size)
    assert cfg.optimizer.zero3_prefetch_bucket_size == 50_000_000
    assert f"{prefetched.gathered / 2**30:.3f}" in out   # all three following layers gathered ahead
