"""Two torchrun launchers on the loopback address (``--nnodes 2``, 4 ranks each) form one TP=2 x PP=2 x DP=2 job
whose losses equal the single-process run: what a two-node launch does, on one machine."""

from __future__ import annotations

import socket
import subprocess

import pretrain_gpt

from ..helpers import NO_DROPOUT, TINY, losses, read_metrics, start

ARGV = [*TINY, *NO_DROPOUT, "--num-layers", "4", "--train-iters", "4", "--micro-batch-size", "1",
        "--adam-eps", "1e-5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_on_loopback_match_the_single_process_run(tmp_path):
    assert pretrain_gpt.main([*ARGV, "--metrics-file", str(tmp_path / "single.jsonl")]) == 0
    port = _free_port()
    argv = ["pretrain_gpt.py", *ARGV, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--metrics-file", str(tmp_path / "two_nodes.jsonl")]
    launchers = [start(argv, nproc=4, stderr=subprocess.STDOUT,   # a two-node rendezvous, not a standalone one
                       torchrun=["--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                                 "--master-port", str(port)])
                 for node in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in launchers]
    assert all(p.returncode == 0 for p in launchers), outputs[0][-3000:] + outputs[1][-3000:]
    single, two_nodes = (losses(read_metrics(tmp_path / name)) for name in ("single.jsonl", "two_nodes.jsonl"))
    assert len(two_nodes) == 4
    assert max(abs(a - b) / b for a, b in zip(two_nodes, single)) < 1e-5
