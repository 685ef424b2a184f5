"""Save and load in one process: exact resume, what --finetune / --no-load-optim restore, when saves happen, and
the one-line errors of a partial or corrupt checkpoint (from pretrain_gpt.py, before anything is built), and a resume
that would move its --save directory's pointer back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pretrain_gpt
from megalite import load_pretrained
from megalite.checkpoint import CheckpointError, check_checkpoint, open_checkpoint
from megalite.checkpoint.directory import POINTER_NAME
from megalite.checkpoint.storage import read_metadata
from megalite.training import Trainer
from megalite.training.stopping import TrainingError

from ..helpers import TINY, losses, read_metrics, single_layout, tiny_config, with_checkpoint
from .helpers import CPU, rewrite_index, train_and_save, without_digests

ARGV = [*TINY, "--train-iters", "4", "--lr", "1e-3"]


@pytest.mark.parametrize("options", [
    {"model": {"hidden_dropout": 0.1, "attention_dropout": 0.1}},          # RNG states come back
    {"training": {"bf16": True}},                                          # fp32 main copies apart from bf16 weights
])
def test_exact_resume(tmp_path, options):
    sections = {"data": {"eval_interval": 0}, **options}
    sections["training"] = {"train_iters": 6, **options.get("training", {})}
    _assert_exact_resume(tiny_config(**sections), tmp_path)


def test_exact_resume_mid_epoch_of_a_text_source_blended_with_a_prefix(corpus, tmp_path):
    """A Parquet file tokenized as it is read (in the prefetch thread), blended with a .bin/.idx: the resumed run
    reads the samples the straight one read, mid-epoch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = corpus.jsonl.read_text(encoding="utf-8").splitlines()
    source = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in lines if line.strip()]), source,
                   row_group_size=64)
    cfg = tiny_config(data={"mock_data": False, "data_path": f"0.6 {source} 0.4 {corpus.prefix}",
                            "tokenizer_model": str(corpus.tokenizer_model), "data_cache_path": str(tmp_path / "cache"),
                            "eval_interval": 0}, training={"train_iters": 4, "global_batch_size": 4})
    _assert_exact_resume(cfg, tmp_path / "ckpt")


def _assert_exact_resume(cfg, directory) -> None:
    """Training cfg's iterations straight, and in two parts (saved after 3, then resumed), gives the same losses."""
    with single_layout():
        straight = losses(Trainer.on_registered_layout(cfg, CPU).train())
    first = train_and_save(cfg, directory, 3)
    with single_layout():
        second = losses(Trainer.on_registered_layout(with_checkpoint(cfg, load=str(directory)), CPU).train())
    assert first + second == straight   # bit for bit


def test_finetune_and_no_load_optim(cfg, saved):
    with single_layout():
        reference = Trainer.on_registered_layout(with_checkpoint(cfg, load=str(saved)), CPU)
        assert reference.state.iteration == 3 and reference.state.consumed_samples == 24
        assert len(reference.optimizer.inner.state) > 0
        weights = [p.detach().clone() for _, p in reference.canonical_named_parameters()]
    for options in ({"finetune": True}, {"no_load_optim": True}):
        with single_layout():
            trainer = Trainer.on_registered_layout(with_checkpoint(cfg, load=str(saved), **options), CPU)
            assert trainer.state.iteration == (0 if "finetune" in options else 3)
            assert len(trainer.optimizer.inner.state) == 0            # Adam starts afresh
            assert all(torch.equal(a, p) for a, (_, p) in zip(weights, trainer.canonical_named_parameters()))


def test_saves_at_interval_and_end_once(tmp_path):
    cfg = with_checkpoint(tiny_config(data={"eval_interval": 0}, training={"train_iters": 5}), save=str(tmp_path),
                          save_interval=2)
    with single_layout():
        Trainer.on_registered_layout(cfg, CPU).train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000005",
                                                          POINTER_NAME]
    with single_layout():   # resuming a finished run trains nothing and saves nothing new
        trainer = Trainer.on_registered_layout(with_checkpoint(cfg, load=str(tmp_path)), CPU)
        assert trainer.train() == [] and trainer.state.iteration == 5
    assert (tmp_path / POINTER_NAME).read_text() == "5\n"


def _files(root) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, modification time in ns) by relative path."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("poison, what", [
    (lambda trainer: next(p for _, p in trainer.canonical_named_parameters()).data.view(-1)[3].fill_(float("nan")),
     "weights"),
    (lambda trainer: next(iter(trainer.optimizer.inner.state.values()))["exp_avg_sq"].view(-1)[0].fill_(float("inf")),
     "optimizer states (Adam moments or fp32 main weights)"),
])
def test_a_save_of_non_finite_weights_or_optimizer_states_is_refused(tmp_path, poison, what):
    cfg = tiny_config(data={"eval_interval": 0})
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, CPU)
        trainer.train_step()
        good = trainer.save_checkpoint(str(tmp_path))
        before = _files(tmp_path)
        trainer.train_step()
        poison(trainer)
        with pytest.raises(TrainingError) as refused:
            trainer.save_checkpoint(str(tmp_path))
    assert str(refused.value) == (f"iteration 2: the {what} are not finite (NaN/inf); the checkpoint was not saved; "
                                  f"the latest good one is {good}")
    assert _files(tmp_path) == before   # nothing written, renamed or removed; the pointer still names iteration 1


def test_pretrain_gpt_save_then_resume_where_load_is_save(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    ckpt = str(tmp_path / "ckpt")
    common = [*ARGV, "--save", ckpt, "--load", ckpt, "--metrics-file", str(metrics)]
    assert pretrain_gpt.main(common) == 0           # nothing saved yet: starts from scratch
    assert "starting from scratch" in capsys.readouterr().out
    assert pretrain_gpt.main([*common, "--train-iters", "6"]) == 0
    iterations = [r["iteration"] for r in read_metrics(metrics)]
    assert iterations == [1, 2, 3, 4, 5, 6]
    assert open_checkpoint(ckpt).manifest.iteration == 6


def test_checkpoint_that_does_not_fit_the_model(cfg, saved, capsys):
    """Another model is refused before its shapes are compared (tests/checkpoint/test_identity.py); with --finetune,
    which loads the weights into another model, the shapes must still fit."""
    assert pretrain_gpt.main([*ARGV, "--hidden-size", "128", "--vocab-size", "301", "--load", str(saved)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megalite: error:") and "\n" not in err
    assert "trained with another model: --hidden-size 64 (checkpoint) vs 128, --ffn-hidden-size 256 (checkpoint) vs " \
           "512 (--use-checkpoint-args takes the model from the checkpoint" in err
    assert pretrain_gpt.main([*ARGV, "--hidden-size", "128", "--vocab-size", "301", "--load", str(saved),
                              "--finetune"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megalite: error:") and "\n" not in err
    assert "does not fit this model: embedding.word.weight is [301, 64] there, [301, 128] here" in err
    assert "model options differ: hidden_size 64 (checkpoint) vs 128" in err


def test_resuming_an_older_checkpoint_into_its_save_directory_is_refused(saved, capsys):
    """--load X/iter_3 --save X while X points to 5 (another run's, maybe): its saves would replace iteration 4 and
    move the pointer back from 5 (before: silently). --override-newer-checkpoint says to go ahead."""
    shutil.copytree(saved / "iter_0000003", saved / "iter_0000005")
    (saved / POINTER_NAME).write_text("5\n")
    argv = [*ARGV, "--vocab-size", "301", "--load", str(saved / "iter_0000003"), "--save", str(saved)]
    assert pretrain_gpt.main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"megalite: error: --save {saved} already points to iteration 5, newer than iteration 3 this run starts from "
        f"(its saves would overwrite checkpoints up to 5 and move {POINTER_NAME} back): choose another --save, or "
        f"pass --override-newer-checkpoint")
    assert (saved / POINTER_NAME).read_text() == "5\n" and not (saved / "iter_0000004").exists()
    assert pretrain_gpt.main([*argv, "--override-newer-checkpoint"]) == 0
    assert (saved / POINTER_NAME).read_text() == "4\n"


def _remove_optimizer_piece(directory):
    metadata = read_metadata(directory)
    key = next(k for k in metadata.state_dict_metadata if k.startswith("optim/layers.1.mlp.linear_fc1.weight/")
               and k.endswith("/exp_avg"))
    del metadata.state_dict_metadata[key]
    rewrite_index(directory, metadata)   # an incomplete checkpoint, not a damaged one


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "manifest.json").unlink(), "not a complete checkpoint: manifest.json is missing"),
    (lambda d: (d / ".metadata").unlink(), "not a complete checkpoint: .metadata (DCP's index) is missing"),
    (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:5000]), "truncated (5000 of"),
    (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp: missing (it holds"),
    (lambda d: (d / "manifest.json").write_text((d / "manifest.json").read_text()[:300]), "unreadable"),
    (_remove_optimizer_piece, "optimizer state exp_avg of layers.1.mlp.linear_fc1.weight (TP slice 0 of 1): "
                              "no pieces at all (--no-load-optim skips optimizer state)"),
    (lambda d: d.rename(d.with_name("moved")), "iter_0000003: missing (named by"),
])
def test_partial_or_corrupt_checkpoint_is_a_one_line_error(saved, capsys, damage, message):
    damage(saved / "iter_0000003")
    assert pretrain_gpt.main([*ARGV, "--vocab-size", "301", "--load", str(saved)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megalite: error:") and "\n" not in err and message in err, err


def test_missing_optimizer_piece_is_fine_without_optimizer(cfg, saved):
    _remove_optimizer_piece(saved / "iter_0000003")
    check_checkpoint(with_checkpoint(cfg, load=str(saved), no_load_optim=True), 1)
    with pytest.raises(CheckpointError, match="optimizer state exp_avg"):
        check_checkpoint(with_checkpoint(cfg, load=str(saved)), 1)


@pytest.mark.parametrize("digests", [True, False])
def test_corrupt_tensor_bytes_are_reported_by_name(saved, digests):
    """Zeroed bytes (same length: only the contents tell): the digest names the item; a checkpoint saved without
    digests fails reading it, named too."""
    if not digests:
        without_digests(saved / "iter_0000003")
    data = saved / "iter_0000003" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[:4000] = bytes(4000)
    data.write_bytes(bytes(raw))
    message = r"__0_0.distcp: checksum mismatch in model/" if digests else r"reading model/.* failed"
    with pytest.raises(CheckpointError, match=message) as error:
        load_pretrained(saved)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("argv, message", [
    (["--save-interval", "2"], "--save-interval needs --save"),
    (["--save", "x", "--save-interval", "0"], "--save-interval must be >= 1, got 0"),
    (["--finetune"], "--finetune needs --load"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--async-save"], "--async-save needs --save"),
    (["--break-save-lock"], "--break-save-lock needs --save"),
    (["--override-newer-checkpoint"], "--override-newer-checkpoint needs --save"),
    (["checkpoint.load=/no/such/dir"], "--load /no/such/dir: no such directory"),
])
def test_checkpoint_options_fail_with_one_line(argv, message, capsys):
    assert pretrain_gpt.main([*ARGV, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"megalite: error: {message}"
