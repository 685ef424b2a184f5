"""--async-save in one process: the save is written in the background while training goes on, yet holds exactly what
a synchronous save at the same iteration holds (bit for bit), is put in place only once written, and the end of
training waits for it. (Killed mid-save: test_kill_during_save.py; several ranks: tests/multiprocess.)"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megalite.checkpoint import open_checkpoint
from megalite.checkpoint.directory import POINTER_NAME
from megalite.training import Trainer
from megalite.training.stopping import TrainingError

from ..helpers import single_layout, tiny_config, with_checkpoint
from .helpers import CPU


def _stored(directory) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(directory)
    return checkpoint.read(list(checkpoint.metadata.state_dict_metadata))


def test_async_save_equals_a_sync_save_while_training_goes_on(tmp_path, monkeypatch):
    cfg = tiny_config(model={"hidden_dropout": 0.1, "attention_dropout": 0.1}, data={"eval_interval": 0},
                      training={"train_iters": 6})
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, CPU)
        for _ in range(3):
            trainer.train_step()
        trainer.save_checkpoint(str(tmp_path / "sync"))

    # The background write is held until training has changed every weight and Adam moment twice more.
    release, write_data = threading.Event(), dcp.FileSystemWriter.write_data

    def held_write_data(self, plan, planner):
        assert release.wait(timeout=60)
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held_write_data)
    with single_layout():
        trainer = Trainer.on_registered_layout(with_checkpoint(cfg, async_save=True), CPU)
        for _ in range(3):
            trainer.train_step()
        assert trainer.save_checkpoint(str(tmp_path / "async")) is None     # in the background
        before = [p.detach().clone() for _, p in trainer.canonical_named_parameters()]
        for _ in range(2):
            trainer.train_step()
        assert not any(torch.equal(a, p) for a, (_, p) in zip(before, trainer.canonical_named_parameters()))
        assert not trainer.finish_save(wait=False) and not (tmp_path / "async" / POINTER_NAME).exists()
        release.set()
        path = trainer.finish_save()
    assert path.name == "iter_0000003" and (tmp_path / "async" / POINTER_NAME).read_text() == "3\n"
    sync, asynchronous = _stored(tmp_path / "sync"), _stored(tmp_path / "async")
    assert sync.keys() == asynchronous.keys() and all(torch.equal(sync[k], asynchronous[k]) for k in sync)
    assert open_checkpoint(tmp_path / "sync").manifest.digests.items == \
        open_checkpoint(tmp_path / "async").manifest.digests.items   # the same bytes


def test_the_end_of_training_waits_for_the_save(tmp_path):
    cfg = with_checkpoint(tiny_config(data={"eval_interval": 0}, training={"train_iters": 5}), save=str(tmp_path),
                          save_interval=2, async_save=True)
    with single_layout():
        Trainer.on_registered_layout(cfg, CPU).train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000005",
                                                          POINTER_NAME]
    assert open_checkpoint(tmp_path).manifest.iteration == 5


def test_async_save_of_non_finite_weights_is_refused_before_anything_is_written(tmp_path):
    """The check runs when the save starts, on the weights being staged, not after the background write: the save
    before it still lands, and the refused one leaves no directory, no .tmp and the pointer as it was."""
    cfg = with_checkpoint(tiny_config(data={"eval_interval": 0}), async_save=True)
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, CPU)
        trainer.train_step()
        assert trainer.save_checkpoint(str(tmp_path)) is None   # in the background
        trainer.train_step()
        with torch.no_grad():
            for _, param in trainer.canonical_named_parameters():
                param.fill_(float("nan"))
        with pytest.raises(TrainingError, match=r"^iteration 2: the weights are not finite \(NaN/inf\); the "
                                                r"checkpoint was not saved; the latest good one is \S+iter_0000001$"):
            trainer.save_checkpoint(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", POINTER_NAME]
    assert (tmp_path / POINTER_NAME).read_text() == "1\n"
