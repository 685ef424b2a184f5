"""On-disk safety: hostile metadata is refused without running it, truncated files are named, the pointer file and
the temporary-then-rename protocol of a save."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from megalite.checkpoint import CheckpointError
from megalite.checkpoint.directory import POINTER_NAME, commit, find_checkpoint, iteration_dir, prepare
from megalite.checkpoint.storage import check_files, read_metadata, read_tensors, safe_reader, tensor_metadata, \
    write_tensors


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_metadata_that_would_run_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable .*which checkpoint metadata may not contain"):
        read_metadata(tmp_path)
    assert not marker.exists()


def test_written_tensors_read_back_and_truncation_is_named(tmp_path):
    tensors = {"model/a/tp1_0": torch.randn(3, 4), "optim/a/tp1_0/0-12/main": torch.randn(12)}
    write_tensors(tmp_path, tensors, collective=False)
    metadata = read_metadata(tmp_path)
    check_files(tmp_path, metadata)
    back = read_tensors(safe_reader(tmp_path, metadata), metadata, list(tensors))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert tensor_metadata(metadata, "model/nope/tp1_0") is None
    data = next(tmp_path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: truncated \(100 of at least \d+ bytes\)"):
        check_files(tmp_path, metadata)
    data.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: missing \(it holds"):
        check_files(tmp_path, metadata)
    (tmp_path / ".metadata").write_bytes((tmp_path / ".metadata").read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable"):
        read_metadata(tmp_path)


def _complete(root, iteration):
    final = iteration_dir(root, iteration)
    temporary = prepare(final)
    (temporary / "manifest.json").write_text("{}")
    commit(temporary, final, iteration)
    return final


def test_commit_renames_then_points(tmp_path):
    first = _complete(tmp_path, 2)
    assert (tmp_path / POINTER_NAME).read_text() == "2\n" and find_checkpoint(tmp_path) == first
    stale = prepare(iteration_dir(tmp_path, 4))       # an interrupted save ...
    assert stale.name == "iter_0000004.tmp" and find_checkpoint(tmp_path) == first   # ... is never read
    second = _complete(tmp_path, 4)                    # the next save clears it
    assert find_checkpoint(tmp_path) == second and not stale.exists()
    again = _complete(tmp_path, 4)                     # re-saving an iteration replaces it
    assert again == second and sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000002", "iter_0000004", POINTER_NAME]
    assert find_checkpoint(first) == first             # a checkpoint directory itself


def test_find_checkpoint_errors(tmp_path):
    assert find_checkpoint(tmp_path / "new", allow_none=True) is None
    assert find_checkpoint(tmp_path, allow_none=True) is None
    with pytest.raises(CheckpointError, match="no such directory"):
        find_checkpoint(tmp_path / "new")
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        find_checkpoint(tmp_path)
    _complete(tmp_path, 3)
    (tmp_path / POINTER_NAME).unlink()
    with pytest.raises(CheckpointError, match="choose a checkpoint, e.g. --load .*iter_0000003"):
        find_checkpoint(tmp_path, allow_none=True)
    (tmp_path / POINTER_NAME).write_text("seven")
    with pytest.raises(CheckpointError, match="unreadable"):
        find_checkpoint(tmp_path)
    (tmp_path / POINTER_NAME).write_text("9")
    with pytest.raises(CheckpointError, match=r"iter_0000009: missing \(named by"):
        find_checkpoint(tmp_path)
