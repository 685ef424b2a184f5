"""Two torchrun launchers on the loopback address (``--nnodes 2``, 4 ranks each) form one TP=2 x PP=2 x DP=2 job
whose losses equal the single-process run: what a two-node launch does, on one machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pretrain_gpt

from ..helpers import losses, read_metrics

ROOT = Path(__file__).resolve().parent.parent.parent
TINY = ["model=gpt_tiny", "data=mock", "--num-layers", "4", "--train-iters", "4", "--micro-batch-size", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0", "--adam-eps", "1e-5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_on_loopback_match_the_single_process_run(tmp_path):
    assert pretrain_gpt.main([*TINY, "--metrics-file", str(tmp_path / "single.jsonl")]) == 0
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    launchers = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                          "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(port),
                          str(ROOT / "pretrain_gpt.py"), *TINY, "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--metrics-file", str(tmp_path / "two_nodes.jsonl")],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in launchers]
    assert all(p.returncode == 0 for p in launchers), outputs[0][-3000:] + outputs[1][-3000:]
    single, two_nodes = (losses(read_metrics(tmp_path / name)) for name in ("single.jsonl", "two_nodes.jsonl"))
    assert len(two_nodes) == 4
    assert max(abs(a - b) / b for a, b in zip(two_nodes, single)) < 1e-5
