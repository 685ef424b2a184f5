"""A stalled rank (SIGSTOP, as a hung GPU or a frozen node looks from outside) makes the others fail within
--distributed-timeout-minutes with one clear line, instead of waiting forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def _worker_pid(launcher_pid: int, local_rank: int) -> int | None:
    """The pid of the torchrun worker with this LOCAL_RANK (read from /proc: no extra dependency)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == launcher_pid and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(entry.name)
    return None


def test_stalled_rank_makes_the_others_fail_within_the_timeout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ROOT / "pretrain_gpt.py"),
         "model=gpt_tiny", "data=mock", "--train-iters", "100000", "--log-interval", "1", "--eval-interval", "0",
         "--distributed-timeout-minutes", "0.1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        for line in launcher.stdout:           # wait until training runs
            if line.startswith("iteration"):
                break
        victim = _worker_pid(launcher.pid, 1)
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
    assert waited < 60
