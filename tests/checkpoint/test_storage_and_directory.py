"""On-disk safety: hostile metadata is refused without running it, truncated files are named, the pointer file and
the temporary-then-rename protocol of a save, and one job per --save directory (its lock, and whose leftovers a
save removes)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess

import pytest
import torch

from megalite.checkpoint import CheckpointError
from megalite.checkpoint.directory import POINTER_NAME, commit, find_checkpoint, iteration_dir, prepare, \
    temporary_dir
from megalite.checkpoint.lock import LOCK_NAME, Owner, SaveLock
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
    assert stale.name == f"iter_0000004.tmp.{os.getpid()}@{socket.gethostname()}"   # named after its writer
    assert find_checkpoint(tmp_path) == first          # ... is never read
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


# ---- one job per --save directory (megalite.checkpoint.lock) --------------------------------------------------------

HOST = socket.gethostname()


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _holder(**fields) -> Owner:
    """Another job's owner: by default a live process on this host (this test's parent), job "other"."""
    return Owner(**{"host": HOST, "pid": os.getppid(), "job": "other", "started": 1.0e9, **fields})


def test_a_second_job_is_refused_while_the_first_holds_the_save_directory(tmp_path):
    first, _ = SaveLock.acquire(tmp_path, owner=_holder())
    me = Owner(HOST, os.getpid(), "mine", 2.0e9)
    with pytest.raises(CheckpointError, match=rf"--save {tmp_path}: in use by another job \(host {HOST}, pid "
                                              rf"{os.getppid()}, job other, since .*\); wait for it to end"):
        SaveLock.acquire(tmp_path, owner=me)
    with pytest.raises(CheckpointError, match="in use by another job"):   # from another host too
        SaveLock.acquire(tmp_path, owner=Owner("elsewhere", 7, "mine"))
    first.release()
    second, line = SaveLock.acquire(tmp_path, owner=me)
    assert line is None and json.loads((tmp_path / LOCK_NAME).read_text())["job"] == "mine"
    first.release()                                   # not its lock any more: left alone
    assert (tmp_path / LOCK_NAME).exists()
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_stale_lock_of_a_dead_process_here_is_taken_over_and_said_so(tmp_path):
    dead = _holder(pid=_dead_pid())
    SaveLock.acquire(tmp_path, owner=dead)           # killed without releasing it
    lock, line = SaveLock.acquire(tmp_path, owner=Owner(HOST, os.getpid(), "mine", 2.0e9))
    assert line.startswith(f"megalite: --save {tmp_path}: took over the lock of host {HOST}, pid {dead.pid}, ")
    assert line.endswith("(its process is gone)") and "\n" not in line
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_on_another_host_is_refused_unless_broken(tmp_path):
    SaveLock.acquire(tmp_path, owner=_holder(host="node7", pid=4242))
    me = Owner(HOST, os.getpid(), "mine", 2.0e9)
    with pytest.raises(CheckpointError, match=r"in use by another job \(host node7, pid 4242, job other, since .*\), "
                                              r"on another host .*; if that job is gone, rerun with "
                                              r"--break-save-lock$"):
        SaveLock.acquire(tmp_path, owner=me)
    lock, line = SaveLock.acquire(tmp_path, break_lock=True, owner=me)
    assert "took over the lock of host node7, pid 4242" in line and line.endswith("(--break-save-lock)")
    lock.release()


def test_a_restart_of_the_same_job_takes_its_lock_back(tmp_path, monkeypatch):
    """torchrun --max-restarts: the same run id, new processes (rank 0 maybe on another node, its old pid unseen)."""
    SaveLock.acquire(tmp_path, owner=_holder(host="node7", pid=4242, job="run-1"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    lock, line = SaveLock.acquire(tmp_path)
    assert line.endswith("(an earlier attempt of this job)") and lock.owner.job == "run-1"
    again, line = SaveLock.acquire(tmp_path)          # this very process again (a failed save, a second main())
    assert line is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")   # torchrun's default run id names no job
    assert Owner.current().job is None
    again.release()


def test_prepare_removes_only_its_own_jobs_and_dead_owners_leftovers(tmp_path):
    me = Owner(HOST, os.getpid(), "run-1", 2.0e9)
    leftovers = {name: temporary_dir(iteration_dir(tmp_path, iteration), owner) for name, iteration, owner in [
        ("live job here", 3, _holder()),
        ("job on another host", 4, _holder(host="node7", pid=4242)),
        ("dead process here", 5, _holder(pid=_dead_pid())),
        ("this job's earlier attempt elsewhere", 6, Owner("node7", 99, "run-1")),
        ("this process", 7, me)]}
    for path in leftovers.values():
        path.mkdir()
    temporary = prepare(iteration_dir(tmp_path, 8), me)
    assert temporary.name == f"iter_0000008.tmp.{me.tag}"
    assert {name for name, path in leftovers.items() if path.exists()} == {"live job here", "job on another host"}
