"""Digests: a save records one per stored item, of DCP's index and of the manifest; --load checks them before any
weight is used and refuses a flipped byte in a payload, the index or the manifest with one line naming the file and
the item; ``convert_checkpoint.py verify`` checks a whole checkpoint offline; a checkpoint saved before digests
loads with a note. (A 2-rank checkpoint, refused on every rank: tests/checkpoint/test_torchrun.py; ranks verifying
a checkpoint together: tests/multiprocess/test_checkpoint.py.)"""

from __future__ import annotations

import pytest

import pretrain_gpt
from megalite import load_pretrained
from megalite.checkpoint import CheckpointError, open_checkpoint, verify_checkpoint
from megalite.checkpoint import digests as digest_module
from megalite.checkpoint.contents import NO_DIGESTS
from megalite.checkpoint.digests import default_algorithm, digest_ranges, even_shares

from ..helpers import TINY, tiny_config
from .helpers import (flip_bytes, flip_index, flip_manifest_key, flip_manifest_value, flip_payload, refused,
                      train_and_save, without_digests)
from .test_tools import _tool as tool

ARGV = [*TINY, "--vocab-size", "301", "--train-iters", "4"]


def test_a_save_records_a_digest_of_every_item_and_verify_passes(saved, capsys):
    checkpoint = open_checkpoint(saved)
    digests = checkpoint.manifest.digests
    assert digests.algorithm == default_algorithm() and digests.index
    assert set(digests.items) == set(checkpoint.metadata.state_dict_metadata)   # model, optimizer and RNG items
    assert tool("convert_checkpoint").main(["verify", "--load", str(saved)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{checkpoint.path}: OK: {len(digests.items)} tensors (") and out.endswith(
        f"in 1 data file(s), the manifest, DCP's index match their {digests.algorithm} digests"), out


@pytest.mark.parametrize("damage", [flip_payload, flip_index, flip_manifest_value, flip_manifest_key])
def test_a_flipped_byte_is_refused_with_one_line(saved, capsys, damage):
    message = damage(saved / "iter_0000003")
    assert refused([*ARGV, "--load", str(saved)], capsys).endswith(f"iter_0000003/{message}")
    assert tool("convert_checkpoint").main(["verify", "--load", str(saved)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint: error: ") and err.endswith(message) and "\n" not in err


def test_only_what_a_load_reads_must_match(saved, capsys):
    """A damaged optimizer state stops a resume; --no-load-optim still loads the weights, which are intact."""
    checkpoint = open_checkpoint(saved)
    index, info = next((i, s) for i, s in checkpoint.metadata.storage_data.items() if i.fqn.endswith("/exp_avg"))
    flip_bytes(saved / "iter_0000003" / info.relative_path, info.offset + info.length - 8)
    assert refused([*ARGV, "--load", str(saved)], capsys).endswith(f"checksum mismatch in {index.fqn}")
    assert pretrain_gpt.main([*ARGV, "--load", str(saved), "--no-load-optim"]) == 0


def test_a_checkpoint_without_digests_loads_with_a_note(saved, capsys):
    """... and fails ``verify`` (nothing says its bytes are the ones saved) unless told --allow-unverified."""
    without_digests(saved / "iter_0000003")
    assert pretrain_gpt.main([*ARGV, "--load", str(saved)]) == 0
    assert NO_DIGESTS in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="--allow-unverified"):
        verify_checkpoint(saved)
    assert tool("convert_checkpoint").main(["verify", "--load", str(saved)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint: error: ") and NO_DIGESTS in err and err.count("\n") == 1
    summary = verify_checkpoint(saved, allow_unverified=True)
    assert summary.startswith(f"{open_checkpoint(saved).path}: complete, ") and summary.endswith(f"; but {NO_DIGESTS}")
    assert tool("convert_checkpoint").main(["verify", "--load", str(saved), "--allow-unverified"]) == 0


def test_sha256_where_xxhash_is_missing(tmp_path, monkeypatch):
    cfg, installed = tiny_config(data={"eval_interval": 0}), default_algorithm()
    train_and_save(cfg, tmp_path / "default", 1)
    monkeypatch.setattr(digest_module, "xxhash", None)
    train_and_save(cfg, tmp_path / "sha", 1)
    assert open_checkpoint(tmp_path / "sha").manifest.digests.algorithm == "sha256"
    assert load_pretrained(tmp_path / "sha").iteration == 1
    if installed == digest_module.XXH3:   # a checkpoint of XXH3 digests, read where xxhash is missing
        with pytest.raises(CheckpointError, match="manifest.json: this checkpoint's digests are xxh3_128, which "
                                                  "needs the xxhash package: pip install xxhash"):
            open_checkpoint(tmp_path / "default")


def test_digest_ranges_and_even_shares(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 4)
    digests = digest_ranges(path, [("a", 0, 256), ("b", 256, 256), ("c", 10, 0)], "sha256")
    assert digests["a"] == digests["b"] != digests["c"]
    with pytest.raises(CheckpointError, match=r"data: truncated \(1024 of at least 1025 bytes, for d\)"):
        digest_ranges(path, [("d", 1, 1024)], "sha256")
    assert even_shares([5, 5, 5, 5], 2) == [(0, 2), (2, 4)]
    assert even_shares([10, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert even_shares([3, 3], 4) == [(0, 1), (1, 1), (1, 2), (2, 2)]
    assert even_shares([], 3) == [(0, 0), (0, 0), (0, 0)]
