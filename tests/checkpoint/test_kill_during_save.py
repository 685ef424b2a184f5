"""kill -9 in the middle of a save leaves the previous checkpoint the one --load finds, intact.

The child process trains with --save-interval 2 and is held, by a test-only patch, inside its second save: after
every rank's tensors and the manifest are written into the temporary directory, just before the rename that
publishes it. That is the latest a crash can strike and still have to leave the old checkpoint in charge. With
--async-save the child is held inside the background write of its second save, its data file written, while its
training thread goes on (two more iterations are logged before the kill). A second job with the same --save, started
while the first is held, is refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from megalite import load_pretrained
from megalite.checkpoint import open_checkpoint

from ..helpers import TINY, read_metrics, start

import pretrain_gpt

ARGV = [*TINY, "--train-iters", "4", "--save-interval", "2"]

CHILD = """
import sys, time
from pathlib import Path
import megalite.checkpoint.directory as directory
import pretrain_gpt

commit, marker = directory.commit, Path(sys.argv[1])

def held_commit(temporary, final, iteration):
    if iteration == 4:
        marker.write_text(str(temporary))
        time.sleep(120)     # killed here
    commit(temporary, final, iteration)

directory.commit = held_commit
sys.exit(pretrain_gpt.main(sys.argv[2:]))
"""


ASYNC_CHILD = """
import sys, time
from pathlib import Path
import megalite.checkpoint.storage as storage
import pretrain_gpt

digest_ranges, marker = storage.digest_ranges, Path(sys.argv[1])

def held_digest_ranges(path, ranges, algorithm):
    if path.parent.name.startswith("iter_0000004.tmp."):
        marker.write_text(str(path.parent))
        time.sleep(120)     # killed here, in the writing thread
    return digest_ranges(path, ranges, algorithm)

storage.digest_ranges = held_digest_ranges
sys.exit(pretrain_gpt.main(sys.argv[2:]))
"""


def _kill_when_held(child: subprocess.Popen, held) -> None:
    """SIGKILL the child once ``held()`` is true."""
    try:
        deadline = time.monotonic() + 120
        while not held():
            assert child.poll() is None, child.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the child never reached its second save"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()


def _start(program: str, marker: Path, *args: str) -> subprocess.Popen:
    return start(["-c", program, str(marker), *args], stdout=subprocess.DEVNULL)


def test_kill_9_during_save_keeps_the_previous_checkpoint(tmp_path, capsys):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "held"
    _kill_when_held(_start(CHILD, marker, *ARGV, "--save", str(ckpt)), marker.exists)
    half_written = Path(marker.read_text())
    assert half_written.name.startswith("iter_0000004.tmp.") and (half_written / "manifest.json").is_file()
    assert open_checkpoint(ckpt).manifest.iteration == 2          # the pointer still names the previous one
    assert load_pretrained(ckpt).iteration == 2                   # and it loads
    # Resuming finishes the run: the killed job's lock is taken over, its leftover cleared by the next save.
    assert pretrain_gpt.main([*ARGV, "--save", str(ckpt), "--load", str(ckpt)]) == 0
    assert open_checkpoint(ckpt).manifest.iteration == 4 and not half_written.exists()
    assert "took over the lock of host" in capsys.readouterr().out and not (ckpt / ".megalite.lock").exists()


def test_a_second_job_on_the_same_save_is_refused_and_leaves_the_first_ones_save_alone(tmp_path, capsys):
    """The first job is held inside its second save, its temporary directory complete; a second job with the same
    --save (before: it trained, and its first save deleted the first job's temporary directory) is refused at
    start-up in one line naming the owner."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "held"
    first = _start(CHILD, marker, *ARGV, "--save", str(ckpt))
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-2000:]
            time.sleep(0.1)
        assert pretrain_gpt.main([*ARGV, "--save", str(ckpt), "--load", str(ckpt)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"megalite: error: --save {ckpt}: in use by another job (host ") and "\n" not in err
        assert f"pid {first.pid}," in err
        assert Path(marker.read_text()).is_dir() and open_checkpoint(ckpt).manifest.iteration == 2
    finally:
        first.kill()
        first.wait(timeout=30)


def test_kill_9_during_an_async_save_keeps_the_previous_checkpoint(tmp_path):
    ckpt, marker, metrics = tmp_path / "ckpt", tmp_path / "held", tmp_path / "metrics.jsonl"

    def held_while_training_went_on() -> bool:
        return marker.exists() and metrics.exists() and any(r["iteration"] >= 6 for r in read_metrics(metrics))

    argv = [*ARGV, "--train-iters", "6", "--global-batch-size", "2", "--save", str(ckpt), "--async-save",
            "--metrics-file", str(metrics)]
    _kill_when_held(_start(ASYNC_CHILD, marker, *argv), held_while_training_went_on)
    half_written = Path(marker.read_text())
    assert half_written.name.startswith("iter_0000004.tmp.") and list(half_written.glob("*.distcp"))
    assert not (half_written / "manifest.json").exists()
    assert open_checkpoint(ckpt).manifest.iteration == 2          # the pointer still names the previous one
    assert load_pretrained(ckpt).iteration == 2                   # and it loads
