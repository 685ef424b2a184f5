"""Stopping on purpose and on failure: SIGTERM saves and exits 0 on every rank, --exit-interval stops after a
checkpoint, a NaN stops training naming the iteration and rank, a rank killed with SIGKILL under
``torchrun --max-restarts`` resumes from the latest checkpoint with the losses of an uninterrupted run, and a stalled
rank (SIGSTOP, as a hung GPU or a frozen node looks from outside) makes the others fail within
--distributed-timeout-minutes with one clear line, instead of waiting forever."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megalite.checkpoint.directory import POINTER_NAME
from megalite.training import Trainer
from megalite.training.stopping import TrainingError

from ..helpers import (NO_DROPOUT, STANDALONE, TINY, read_metrics, single_layout, start, tiny_config, with_checkpoint,
                       worker_pid)

ARGV = [*TINY, *NO_DROPOUT, "--log-interval", "1"]


def _records(path: Path) -> list[dict]:
    return [r for r in read_metrics(path) if "loss" in r]


def _launch(*args: str, restarts: int = 0) -> subprocess.Popen:
    return start(["pretrain_gpt.py", *ARGV, *args], nproc=2, torchrun=[*STANDALONE, "--max-restarts", str(restarts)])


def _wait_for_iteration(launcher: subprocess.Popen, iteration: int) -> None:
    for line in launcher.stdout:
        if line.startswith(f"iteration {iteration:>6}/"):
            return
    raise AssertionError("training ended before iteration %d" % iteration)


def test_nan_stops_training_naming_iteration_and_rank(capsys):
    assert pretrain_gpt.main([*ARGV, "--train-iters", "3", "--lr", "1e30", "--clip-grad", "0"]) == 1
    err = capsys.readouterr().err
    assert "megalite: error: iteration 2: loss is nan" in err and "rank(s) [0]" in err


def test_a_step_that_poisons_the_weights_is_not_saved_though_its_loss_was_finite(tmp_path):
    """fp32: the step of iteration 4 overflows every weight (as a huge learning rate can) after a finite loss and
    gradient norm; the save at 4 is refused, instead of becoming the one --load picks before the loss of 5 tells."""
    cfg = with_checkpoint(tiny_config(data={"eval_interval": 0}, training={"train_iters": 6}), save=str(tmp_path),
                          save_interval=2)
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, torch.device("cpu"))
        step = trainer.optimizer.step

        def overflowing_step(*args, **kwargs):
            result = step(*args, **kwargs)
            if trainer.state.iteration == 3:   # the step of iteration 4
                for _, param in trainer.canonical_named_parameters():
                    param.data.fill_(float("inf"))
            return result

        trainer.optimizer.step = overflowing_step
        with pytest.raises(TrainingError) as stopped:
            trainer.train()
    assert str(stopped.value) == (f"iteration 4: the weights are not finite (NaN/inf); the checkpoint was not saved; "
                                  f"the latest good one is {tmp_path / 'iter_0000002'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", POINTER_NAME]


def _fp16_lr_1e10(**sections):
    """The tester's run (fp16, --lr 1e10), its scale starting at 2^22 rather than 2^32 to be short: the gradients
    overflow at 2^22 and 2^21, the first step taken (iteration 4, at 2^20) sends the fp16 weights to inf, and every
    loss after it is NaN."""
    return tiny_config(data={"eval_interval": 0}, optimizer={"lr": 1e10, "lr_warmup_iters": 0,
                                                             "initial_loss_scale": 2.0**22},
                       training={"fp16": True, "train_iters": 30}, **sections)


def test_fp16_poisoned_weights_are_not_saved(tmp_path):
    cfg = with_checkpoint(_fp16_lr_1e10(), save=str(tmp_path), save_interval=2)
    with single_layout(), pytest.raises(TrainingError) as stopped:
        Trainer.on_registered_layout(cfg, torch.device("cpu")).train()
    assert str(stopped.value) == (f"iteration 4: the weights are not finite (NaN/inf); the checkpoint was not saved; "
                                  f"the latest good one is {tmp_path / 'iter_0000002'}")
    assert (tmp_path / POINTER_NAME).read_text() == "2\n"


def test_fp16_whose_loss_stays_nan_gives_up_after_ten_skipped_steps():
    """A NaN loss is no overflow: lowering the scale cannot fix it (the scale multiplies the loss after the forward
    pass). Iteration 5 is the first NaN loss, 14 the tenth, the scale still far above its minimum (1)."""
    with single_layout(), pytest.raises(TrainingError) as stopped:
        Trainer.on_registered_layout(_fp16_lr_1e10(), torch.device("cpu")).train()
    assert str(stopped.value) == ("iteration 14: the loss was not finite (NaN/inf) in 10 steps in a row, each skipped "
                                  "by --fp16; stopping: a loss scale cannot fix that (it scales the loss after the "
                                  "forward pass), the weights or the data are broken (try --bf16 or a lower --lr)")


def test_exit_interval_stops_after_a_checkpoint(tmp_path, capsys):
    assert pretrain_gpt.main([*ARGV, "--train-iters", "10", "--exit-interval", "3", "--save", str(tmp_path)]) == 0
    assert "stopping after iteration 3: --exit-interval 3" in capsys.readouterr().out
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_sigterm_on_one_rank_saves_on_every_rank_and_exits_zero(tmp_path):
    launcher = _launch("--train-iters", "100000", "--exit-signal-handler", "--save", str(tmp_path))
    try:
        _wait_for_iteration(launcher, 2)
        os.kill(worker_pid(launcher.pid, 1), signal.SIGTERM)   # a scheduler may signal ranks one by one
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert "megalite: stopping after iteration" in out and "SIGTERM received" in out
    saved = int((tmp_path / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2
    # The checkpoint loads: one more iteration from it.
    assert pretrain_gpt.main([*ARGV, "--train-iters", str(saved + 1), "--load", str(tmp_path)]) == 0


def test_killed_rank_restarts_and_resumes_with_uninterrupted_losses(tmp_path):
    iters = ["--train-iters", "8", "--micro-batch-size", "1"]
    assert pretrain_gpt.main([*ARGV, *iters, "--metrics-file", str(tmp_path / "straight.jsonl")]) == 0
    ckpt = tmp_path / "ckpt"
    launcher = _launch(*iters, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
                       "--metrics-file", str(tmp_path / "restarted.jsonl"), restarts=1)
    try:
        _wait_for_iteration(launcher, 5)   # checkpoints at 2 and 4 exist by now
        os.kill(worker_pid(launcher.pid, 1), signal.SIGKILL)
        out, err = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    # A second attempt ran, and it resumed from a checkpoint before the last one (iteration 8): the kill landed while
    # the first attempt was still training, not after it had finished.
    first, restarted_log = out.split("megalite: torchrun restart 1 of 1\n")
    resumed_from = re.search(r"loaded checkpoint \S*iter_(\d+)", restarted_log)
    assert resumed_from and 2 <= int(resumed_from.group(1)) < 8, out
    straight = {r["iteration"]: r["loss"] for r in _records(tmp_path / "straight.jsonl")}
    restarted = {}
    for r in _records(tmp_path / "restarted.jsonl"):   # the restart rewrites iterations after its checkpoint
        restarted[r["iteration"]] = r["loss"]
    assert sorted(restarted) == list(range(1, 9))
    assert max(abs(restarted[i] - straight[i]) / straight[i] for i in straight) < 1e-5


def test_stalled_rank_makes_the_others_fail_within_the_timeout(tmp_path):
    launcher = start(["pretrain_gpt.py", *TINY, "--train-iters", "100000", "--log-interval", "1",
                      "--distributed-timeout-minutes", "0.1"], nproc=2)
    victim = None
    try:
        for line in launcher.stdout:           # wait until training runs
            if line.startswith("iteration"):
                break
        victim = worker_pid(launcher.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGSTOP)
        stalled_at = time.monotonic()
        err = ""
        for line in launcher.stderr:           # rank 0 must give up on its own, after ~6 s
            err += line
            if "megalite: error:" in line:
                break
        waited = time.monotonic() - stalled_at
    finally:
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
    assert "a collective timed out after --distributed-timeout-minutes 0.1: another rank died or stalled" in err
    assert "rank 0" in err
    # The stalled rank answers no roll call, and the line says which collective waited for it.
    assert "rank(s) 1 did not answer a roll call" in err and " over the " in err and "ranks [0, 1]" in err, err
    assert waited < 60
