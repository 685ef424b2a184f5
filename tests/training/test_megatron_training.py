"""Training the way Megatron's scripts ask, in one process: a batch ramp-up with sample-based length and learning rate
(each iteration's batch and rate as megalite.config.batches and the LR schedule say; resumed mid-ramp, the losses of
an uninterrupted run bit for bit), --decoupled-lr, --manual-gc, --profile (a trace Perfetto and TensorBoard open) and
Weights & Biases (offline), with one line when wandb is missing."""

from __future__ import annotations

import builtins
import dataclasses
import gc
import json

import pytest
import torch

import pretrain_gpt
from megalite.config import LoggingConfig
from megalite.config.batches import batch_schedule
from megalite.optimizer import LRSchedule
from megalite.training import Trainer
from megalite.training.metrics import MetricsLogger

from ..checkpoint.helpers import CPU
from ..helpers import losses, read_metrics, single_layout, tiny_config, with_checkpoint

RAMP = {"global_batch_size": 8, "rampup_batch_size": "2 2 12", "train_iters": None, "train_samples": 36}
SAMPLES = {"lr_warmup_iters": 0, "lr_warmup_samples": 10, "lr_decay_samples": 28}


def _ramp_config(**sections):
    return tiny_config(training={**RAMP, "micro_batch_size": 2}, optimizer={**SAMPLES, "decoupled_lr": 3e-3},
                       data={"eval_interval": 0}, **sections)


def test_rampup_batches_learning_rates_length_and_resume_follow_the_schedules(tmp_path):
    cfg = _ramp_config(model={"hidden_dropout": 0.1})
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, CPU)
        records = trainer.train()
        # Resumed mid-ramp (after 3 iterations, before the batch of 6): the uninterrupted run's losses, bit for bit.
        first = Trainer.on_registered_layout(with_checkpoint(cfg, save=str(tmp_path)), CPU)
        head = [first.train_step()["loss"] for _ in range(3)]
        first.save_checkpoint(str(tmp_path))
        rest = losses(Trainer.on_registered_layout(with_checkpoint(cfg, load=str(tmp_path)), CPU).train())
    assert head + rest == losses(records)
    schedule = batch_schedule(cfg.training, cfg.model.seq_length)
    lr = LRSchedule.from_config(cfg.optimizer, cfg.training, cfg.model.seq_length)
    # Ramp 2 -> 8 in 3 steps of 2 over 12 samples (a step every 4), then 8s: Megatron counts 6 iterations for 36
    # samples (4 while consumed <= 12, then (36 - 14) // 8).
    assert [r["global_batch_size"] for r in records] == [2, 2, 4, 6, 8, 8]
    assert [r["global_batch_size"] for r in records] == [schedule.at(r["consumed_samples"] - r["global_batch_size"])
                                                         for r in records]
    assert [r["consumed_samples"] for r in records] == [2, 4, 8, 14, 22, 30]
    assert trainer.train_iters == 6 and len(trainer.data.train) == 30
    assert [r["lr"] for r in records] == [lr.at(r["consumed_samples"], 1e-3, 1e-4) for r in records]
    assert [r["decoupled_lr"] for r in records] == [lr.at(r["consumed_samples"], 3e-3, 1e-4) for r in records]
    assert records[0]["lr"] == pytest.approx(1e-3 * 2 / 10) and records[-1]["lr"] == 1e-4
    # The word embedding (tied: also the output layer) steps at the decoupled rate, everything else at lr.
    rates = {g["decoupled"]: g["lr"] for g in trainer.optimizer.inner.param_groups if g["params"]}
    assert rates == {False: records[-1]["lr"], True: records[-1]["decoupled_lr"]}
    decoupled = [p for g in trainer.optimizer.inner.param_groups if g["decoupled"] for p in g["params"]]
    assert [p.numel() for p in decoupled] == [trainer.model[0].embedding.word.weight.numel()]


def test_flags_of_a_megatron_run_end_to_end(tmp_path, monkeypatch, capsys):
    """One short run with the observability flags of Megatron's scripts: the profile trace of iterations 2-3, the
    metrics in an offline W&B run, collection by hand (the automatic collector is back on afterwards)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    seen = []
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: seen.append(gc.isenabled()) or original(self))
    argv = ["model=gpt_tiny", "data=mock", "--train-iters", "3", "--eval-interval", "0", "--manual-gc",
            "--manual-gc-interval", "2", "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
            "--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "megalite-test", "--wandb-exp-name", "run",
            "--wandb-save-dir", str(tmp_path / "wandb"), "--metrics-file", str(tmp_path / "m.jsonl")]
    assert pretrain_gpt.main(argv) == 0
    assert seen == [False] * 3 and gc.isenabled()
    trace = tmp_path / "tb" / "rank0.iterations2-3.pt.trace.json"
    assert "profile of iterations 2-3 written to" in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)
    run, = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    assert list(run.glob("run-*.wandb")) and len(read_metrics(tmp_path / "m.jsonl")) == 3


def test_wandb_logs_the_metrics_and_missing_wandb_is_one_line(tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(wandb_project="p", wandb_save_dir=str(tmp_path))
    logger = MetricsLogger(cfg, True, 2, tiny_config())
    calls, log = [], logger.wandb.log
    logger.wandb.log = lambda data, step: calls.append((data, step)) or log(data, step=step)
    logger.log({"iteration": 1, "loss": 5.5, "lr": 1e-3})
    logger.log({"iteration": 2, "loss": 5.25, "lr": 2e-3, "skipped": None})
    assert calls == [({"loss": 5.5, "lr": 1e-3}, 1), ({"loss": 5.25, "lr": 2e-3}, 2)]
    # wandb commits a step once the next one starts: iteration 1's row is in the run, iteration 2's at finish.
    assert logger.wandb.summary["loss"] == 5.5 and logger.wandb.config["training"]["train_iters"] == 10
    logger.close()
    assert wandb.run is None
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *args, **kwargs: (
        (_ for _ in ()).throw(ImportError(name)) if name == "wandb" else real_import(name, *args, **kwargs)))
    capsys.readouterr()
    assert MetricsLogger(cfg, True, 2).wandb is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "--wandb-project p needs the wandb package" in out


def test_grad_reduce_in_bf16_keeps_bf16_gradients_and_learns():
    cfg = tiny_config(training={"bf16": True, "train_iters": 3}, optimizer={"grad_reduce_in_bf16": True},
                      data={"eval_interval": 0})
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, CPU)
        assert trainer.engine.grad_buffer.dtype == torch.bfloat16
        assert all(p.main.dtype == torch.float32 for p in trainer.optimizer.pieces)
        bf16_grads = losses(trainer.train())
        fp32_grads = losses(Trainer.on_registered_layout(dataclasses.replace(cfg, optimizer=dataclasses.replace(
            cfg.optimizer, grad_reduce_in_bf16=False)), CPU).train())
    assert bf16_grads[-1] < bf16_grads[0]
    assert max(abs(a - b) / b for a, b in zip(bf16_grads, fp32_grads)) < 1e-2
