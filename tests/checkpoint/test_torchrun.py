"""pretrain_gpt.py under torchrun: a DP=2 run saves (one file per rank), and a damaged checkpoint stops every rank
with the same one line, exit code 2, before any collective."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from megalite import load_pretrained
from megalite.checkpoint import open_checkpoint

ROOT = Path(__file__).resolve().parent.parent.parent
TINY = ["model=gpt_tiny", "data=mock", "--eval-interval", "0", "--train-iters", "2"]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    # --standalone: a free port of its own, so concurrent launches on the machine cannot collide.
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "pretrain_gpt.py"), *TINY, *args],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)


def test_data_parallel_save_and_a_truncated_checkpoint_on_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = _torchrun("--save", str(ckpt))
    assert saved.returncode == 0, saved.stderr[-3000:]
    checkpoint = open_checkpoint(ckpt)
    assert checkpoint.manifest.layout.dp == 2 and checkpoint.manifest.iteration == 2
    assert sorted(p.name for p in checkpoint.path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert load_pretrained(ckpt)(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 500)   # DP rank 0 wrote it all

    rank_file = checkpoint.path / "__1_0.distcp"
    rank_file.write_bytes(rank_file.read_bytes()[:64])
    bad = _torchrun("--load", str(ckpt), "--tensor-model-parallel-size", "2")
    assert bad.returncode != 0
    lines = [line for line in bad.stderr.splitlines() if "megalite: error:" in line]
    assert len(lines) == 2 and all("__1_0.distcp: truncated (64 of at least" in line for line in lines), bad.stderr
    # torchrun's own report of the failed ranks is a traceback of its agent, but no frame comes from the ranks' code:
    # neither megalite (wherever it is checked out) nor torch's checkpoint reader.
    frames = re.findall(r'File "([^"]+)"', bad.stderr)
    assert not [f for f in frames if Path(f).is_absolute() and Path(f).resolve().is_relative_to(ROOT)
                or "distributed/checkpoint" in f], bad.stderr
