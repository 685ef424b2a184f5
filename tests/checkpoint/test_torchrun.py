"""pretrain_gpt.py under torchrun: a DP=2 run saves (one file per rank); byte flips in a payload, in the index and in
the manifest of that 2-rank checkpoint are each refused with one line (the payload's by the 2 ranks of a TP=2 load,
which verify it together, each printing the same line; the others in the pre-flight every rank runs alike, shown
here in one process), exit code 2; ``verify`` accepts the good copy and refuses the bad ones."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from megalite import load_pretrained
from megalite.checkpoint import open_checkpoint

from ..helpers import ROOT, TINY, launch
from .helpers import flip_index, flip_manifest_value, flip_payload, refused
from .test_tools import _tool

ARGV = [*TINY, "--train-iters", "2"]


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("two_ranks") / "ckpt"
    saved = launch(["pretrain_gpt.py", *ARGV, "--save", str(ckpt)], nproc=2)
    assert saved.returncode == 0, saved.stderr[-3000:]
    return ckpt


def test_data_parallel_save(two_rank_checkpoint, capsys):
    checkpoint = open_checkpoint(two_rank_checkpoint)
    assert checkpoint.manifest.layout.dp == 2 and checkpoint.manifest.iteration == 2
    assert sorted(p.name for p in checkpoint.path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert {info.relative_path for info in checkpoint.metadata.storage_data.values()} == {"__0_0.distcp",
                                                                                          "__1_0.distcp"}
    assert set(checkpoint.manifest.digests.items) == set(checkpoint.metadata.state_dict_metadata)   # both ranks'
    assert load_pretrained(two_rank_checkpoint)(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 500)
    assert _tool("convert_checkpoint").main(["verify", "--load", str(two_rank_checkpoint)]) == 0
    assert ": OK: " in capsys.readouterr().out


@pytest.mark.parametrize("damage", [flip_index, flip_manifest_value])
def test_a_damaged_index_or_manifest_is_refused(two_rank_checkpoint, tmp_path, capsys, damage):
    copy = tmp_path / "ckpt"
    shutil.copytree(two_rank_checkpoint, copy)
    message = damage(copy / "iter_0000002")
    assert refused([*ARGV, "--load", str(copy)], capsys).endswith(message)
    assert _tool("convert_checkpoint").main(["verify", "--load", str(copy)]) == 2
    assert capsys.readouterr().err.strip().endswith(message)


def test_a_damaged_payload_stops_every_rank_with_one_line(two_rank_checkpoint, tmp_path, capsys):
    copy = tmp_path / "ckpt"
    shutil.copytree(two_rank_checkpoint, copy)
    message = flip_payload(copy / "iter_0000002")
    assert _tool("convert_checkpoint").main(["verify", "--load", str(copy)]) == 2
    assert capsys.readouterr().err.strip().endswith(message)
    bad = launch(["pretrain_gpt.py", *ARGV, "--load", str(copy), "--tensor-model-parallel-size", "2"], nproc=2)
    assert bad.returncode != 0
    lines = [line for line in bad.stderr.splitlines() if "megalite: error:" in line]
    assert len(lines) == 2 and all(line.endswith(f"iter_0000002/{message}") for line in lines), bad.stderr
    # torchrun's own report of the failed ranks is a traceback of its agent, but no frame comes from the ranks' code:
    # neither megalite (wherever it is checked out) nor torch's checkpoint reader.
    frames = re.findall(r'File "([^"]+)"', bad.stderr)
    assert not [f for f in frames if Path(f).is_absolute() and Path(f).resolve().is_relative_to(ROOT)
                or "distributed/checkpoint" in f], bad.stderr
