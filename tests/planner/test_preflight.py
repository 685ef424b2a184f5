"""Start-up checks against the machine (megalite.planner.preflight), in-process through ``pretrain_gpt.main``: places
that cannot be written, a disk too small for a checkpoint or full at a save, a model too big for the memory."""

from __future__ import annotations

import errno
from collections import namedtuple

import pytest
import torch

import pretrain_gpt
from megalite.checkpoint import directory as ckpt_dir
from megalite.config import ConfigError
from megalite.config.cli import parse_args
from megalite.planner import count_parameters, preflight
from megalite.planner.dry_run import run_memory
from megalite.planner.hardware import GiB
from megalite.training.trainer import Trainer

ARGV = ["model=gpt_tiny", "data=mock", "--train-iters", "1", "--eval-interval", "0"]
Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _refused(argv, capsys) -> str:
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megalite: error:") and "\n" not in err, err
    return err


@pytest.mark.parametrize("flag, make, words", [
    ("--save", lambda tmp: tmp / "file", "a regular file, not a directory"),          # an existing regular file
    ("--save", lambda tmp: tmp / "file" / "ckpt", "a regular file, not a directory"),  # a path under one
    ("--tensorboard-dir", lambda tmp: tmp / "file" / "tb", "a regular file, not a directory"),
    ("--metrics-file", lambda tmp: tmp / "file" / "m.jsonl", "a regular file, not a directory"),
    ("--metrics-file", lambda tmp: tmp, "a directory, not a file"),
])
def test_a_place_the_run_cannot_write_is_refused_before_training(flag, make, words, tmp_path, capsys, one_process,
                                                                 monkeypatch):
    # (chmod cannot make a directory unwritable for root: a regular file in the way fails for everyone.)
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(Trainer, "__init__", lambda *args: pytest.fail("refused before the trainer is built"))
    path = make(tmp_path)
    err = _refused(ARGV + [flag, str(path)], capsys)
    assert f"{flag} {path}" in err and words in err


def test_missing_output_directories_are_made_as_the_run_would(tmp_path, one_process):
    cfg = parse_args(["--save", str(tmp_path / "a" / "ckpt"), "--metrics-file", str(tmp_path / "b" / "m.jsonl"),
                      "--tensorboard-dir", str(tmp_path / "c" / "tb")])
    preflight.check_outputs(cfg)
    assert (tmp_path / "a" / "ckpt").is_dir() and (tmp_path / "b").is_dir() and (tmp_path / "c" / "tb").is_dir()
    assert [p.name for p in (tmp_path / "a" / "ckpt").iterdir()] == []   # the write probe leaves nothing behind


def test_no_room_for_one_checkpoint_is_refused_with_the_numbers(tmp_path, capsys, one_process, monkeypatch):
    cfg = parse_args(ARGV)
    needed = preflight.checkpoint_bytes(cfg)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: Usage(10 * GiB, 10 * GiB, needed / 2))
    err = _refused(ARGV + ["--save", str(tmp_path / "ckpt")], capsys)
    assert f"--save {tmp_path / 'ckpt'}: a checkpoint needs ~{needed / GiB:,.2f} GiB" in err
    assert f"{needed / 2 / GiB:,.2f} GiB free" in err


def test_the_checkpoint_estimate_counts_every_parameter_with_its_adam_states():
    for argv in (["model=gpt_tiny"], ["model=gpt_tiny", "--num-experts", "4", "--moe-layer-freq", "2"],
                 ["model=gpt_tiny", "--untie-embeddings-and-output-weights", "--bf16"]):
        cfg = parse_args(argv)
        total = count_parameters(cfg.model).total
        assert preflight.parameter_count(cfg) == total
        assert preflight.checkpoint_bytes(cfg) == total * ((2 if "--bf16" in argv else 4) + 12)


@pytest.mark.parametrize("where, failure", [
    ("directory", OSError(errno.ENOSPC, "No space left on device")),   # rank 0 making the checkpoint's directory
    ("tensors", OSError(errno.ENOSPC, "No space left on device")),     # DCP writing a tensor (its wrapped error)
    ("tensors", RuntimeError("[enforce fail at inline_container.cc:858] . unexpected pos 704 vs 598")),   # torch's
])                                                                    # writer's words for a short write
def test_a_save_that_finds_the_disk_full_says_so_in_one_line(where, failure, tmp_path, capsys, one_process,
                                                             monkeypatch):
    def full(*args, **kwargs):
        raise failure

    if where == "directory":
        monkeypatch.setattr(ckpt_dir, "prepare", full)
    else:   # DCP's file writer serializes each tensor with torch.save
        monkeypatch.setattr(torch, "save", full)
    if isinstance(failure, RuntimeError):   # no ENOSPC to read: the disk, full since start-up, tells
        monkeypatch.setattr(preflight, "check_disk_space", lambda cfg: None)
        monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: Usage(GiB, GiB, 4096))
    assert pretrain_gpt.main(ARGV + ["--save", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err.strip()
    needed = preflight.checkpoint_bytes(parse_args(ARGV))
    assert err.startswith("megalite: error: rank 0: no space left on device writing ") and "\n" not in err, err
    assert f"(needs ~{needed / GiB:,.2f} GiB, " in err and "GiB free)" in err


@pytest.mark.parametrize("flag, value", [("--hidden-size", "1000000000"), ("--num-layers", "100000")])
def test_a_model_far_too_big_for_the_host_is_one_line_at_start_up(flag, value, capsys, one_process, monkeypatch):
    monkeypatch.setattr(Trainer, "__init__", lambda *args: pytest.fail("refused before the trainer is built"))
    err = _refused(["model=gpt_tiny", flag, value], capsys)
    assert "the model does not fit this host" in err and "--skip-memory-check" in err


def test_the_refusal_quotes_the_dry_run_and_the_escape_hatch_starts_anyway(capsys, one_process, monkeypatch):
    cfg = parse_args(ARGV)
    _, (stage,) = run_memory(cfg, 1, cuda=False)
    monkeypatch.setattr(preflight, "available_host_memory", lambda: stage.total * 0.99)   # above the floor
    monkeypatch.setattr(Trainer, "train", lambda self: None)
    err = _refused(ARGV, capsys)
    assert f"stage 0: {stage.total / GiB:,.2f} GiB (weights {stage.weights / GiB:,.2f} + " in err
    assert "as --dry-run prints" in err and "--skip-memory-check" in err
    assert pretrain_gpt.main(ARGV + ["--skip-memory-check"]) == 0


def test_the_host_is_shared_by_its_local_ranks_and_a_gpu_is_its_own(monkeypatch):
    cfg = parse_args(["model=gpt_tiny", "--tensor-model-parallel-size", "2"])
    _, (stage,) = run_memory(cfg, 4, cuda=False)
    monkeypatch.setattr(preflight, "available_host_memory", lambda: stage.total * 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    preflight.check_memory(cfg, 4, cuda=False)            # two ranks on this host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="for 4 ranks on this host"):
        preflight.check_memory(cfg, 4, cuda=False)
    _, (gpu_stage,) = run_memory(cfg, 4, cuda=True)
    device = namedtuple("Properties", "total_memory")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: device(int(gpu_stage.total * 1.01)))
    preflight.check_memory(cfg, 4, cuda=True)             # each rank its own GPU
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: device(int(gpu_stage.total * 0.99)))
    with pytest.raises(ConfigError, match="does not fit this GPU .* per GPU"):
        preflight.check_memory(cfg, 4, cuda=True)


def test_available_host_memory_needs_no_psutil():
    assert 0 < preflight.available_host_memory() < float("inf")
