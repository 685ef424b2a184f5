"""Shared test helpers: tiny configurations (as dataclasses and as command-line words), the single-process layout,
launching pretrain_gpt.py or a tool as a child process (under torchrun or alone), training records and tolerances."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import types
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import (DataConfig, LoggingConfig, MegaliteConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                             TrainingConfig)

ROOT = Path(__file__).resolve().parent.parent   # this checkout, whatever its folder is called


def tiny_config(tp: int = 1, pp: int = 1, **sections) -> MegaliteConfig:
    """A GPT small enough for 2 CPU cores; an odd vocabulary so padding differs between TP sizes.

    ``sections`` override fields by section, e.g. ``training={"micro_batch_size": 1}``.
    """
    cfg = MegaliteConfig(
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=301,
                          hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2),
        data=DataConfig(mock_data=True, eval_interval=5, eval_iters=2),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=10, seed=1234),
        logging=LoggingConfig(log_interval=1),
    )
    for section, values in sections.items():
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **values))
    return cfg


# A tiny GPT's command line (configs/model/gpt_tiny.yaml: 2 layers, hidden 64, 4 heads, 32 tokens, vocabulary 500)
# on mock data, evaluation off. A test adds what it needs: a later flag, or a group chosen again (model=moe_tiny),
# wins over TINY's (flags are applied after Hydra overrides, each kind left to right: megalite/config/cli.py).
TINY = ["model=gpt_tiny", "data=mock", "--eval-interval", "0"]
# Dropout off: for runs whose losses are compared with another run's.
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


# A tiny mixture of experts (model options for ``tiny_config``): 4 experts of 32, top-2, both layers MoE, with the
# load-balancing and z losses on so that their gradients are part of every comparison.
TINY_MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 1e-2,
            "moe_z_loss_coeff": 1e-3}


def with_checkpoint(cfg: MegaliteConfig, **options) -> MegaliteConfig:
    """``cfg`` with checkpoint options replaced, e.g. ``with_checkpoint(cfg, save=directory, save_interval=4)``."""
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **options))


@contextlib.contextmanager
def single_layout():
    """A 1x1x1 layout of this process alone inside the block (under torchrun: of this rank alone, the single-process
    reference; it communicates with no one)."""
    parallel_state.initialize_model_parallel(1, 1, ranks=[dist.get_rank()] if dist.is_initialized() else None)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def meta_only_world(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1):
    """Inside the block, this process is rank 0 of a simulated world of ``world_size`` whose groups, like NCCL's,
    refuse tensors of the wrong device (megalite.simulation.world: torch's FakeProcessGroup for the "meta" device
    only, so a CPU tensor in a collective raises "No backend type associated with device type cpu" as on an NCCL
    group). A TP x PP layout (EP carved from DP) is registered on it."""
    from megalite.simulation.world import simulated_world

    with simulated_world(world_size, 0):
        parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def losses(records: list[dict]) -> list[float]:
    """The training losses of Trainer.train's records (or a metrics file's), evaluations left out."""
    return [r["loss"] for r in records if "loss" in r]


def read_metrics(path: Path) -> list[dict]:
    """The records of a --metrics-file, one JSON object a line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def max_relative_difference(actual: list[float], expected: list[float]) -> float:
    return max(abs(a - e) / max(abs(e), 1e-12) for a, e in zip(actual, expected, strict=True))


# fp32 has a 2**-23 (1.2e-7) relative rounding step. A parallel layer computes the same sums as the serial one in
# another order (partial sums per TP rank, then an all-reduce), so each element may differ by about one rounding of
# the largest partial sum per addition. Bounding the difference by REL_TO_SCALE times the tensor's largest magnitude
# allows ~80 such roundings: more than the terms of any sum in these tests (at most a few dozen), and far below what a
# wrong shard or a missing reduction gives (order 1 relative).
REL_TO_SCALE = 1e-5


def assert_close_to_scale(actual, expected, rel: float = REL_TO_SCALE) -> None:
    """``actual`` equals ``expected`` within ``rel`` of ``expected``'s largest magnitude (see REL_TO_SCALE)."""
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, atol=rel * max(scale, 1.0), rtol=0)


def fake_fused_extension(**replaced) -> types.ModuleType:
    """A stand-in for the CUDA extension: the kernels' torch ops (megalite/kernels/torch_ops.py), which pass the
    self-check, with the functions named in ``replaced`` swapped (e.g. for a wrong kernel)."""
    from megalite.kernels import torch_ops

    module = types.ModuleType("megalite_fused")
    module.__dict__.update({name: getattr(torch_ops, name) for name in dir(torch_ops) if not name.startswith("_")})
    module.__dict__.update(replaced)
    return module


# torchrun's rendezvous on a free port of its own, so that concurrent launches on the machine cannot collide.
STANDALONE = ("--standalone",)


def child_environment() -> dict[str, str]:
    """This process's environment for a child: without the rank variables of a torchrun this test may run under (the
    child starts a world of its own), and with this checkout first on PYTHONPATH, so that the child imports this copy
    of megalite rather than an installed one."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def child_command(argv: Sequence[str], nproc: int | None = None, torchrun: Sequence[str] = STANDALONE) -> list[str]:
    """The command that runs ``argv``: a script of this checkout and its words (``["pretrain_gpt.py", *TINY]``,
    ``["tools/gpu_check.py"]``; made absolute, so tracebacks name the checkout's files) or ``["-c", code, ...]``.
    With ``nproc``, under torchrun with that many ranks per node and the launcher options ``torchrun`` (a standalone
    rendezvous unless told otherwise, e.g. a two-node one); without, in one plain Python process."""
    program = [str(ROOT / argv[0]), *argv[1:]] if argv[0].endswith(".py") else list(argv)
    if nproc is None:
        return [sys.executable, *program]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun, "--nproc-per-node", str(nproc), *program]


def start(argv: Sequence[str], nproc: int | None = None, torchrun: Sequence[str] = STANDALONE,
          **popen) -> subprocess.Popen:
    """Start ``argv`` (see child_command) from the checkout's root, its output piped as text unless ``popen`` says
    otherwise; for a test that acts on the child while it runs."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(child_command(argv, nproc, torchrun), cwd=ROOT, env=child_environment(), **options)


def launch(argv: Sequence[str], nproc: int | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``argv`` (see child_command) from the checkout's root to its end, its output captured as text."""
    return subprocess.run(child_command(argv, nproc), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=child_environment())


def worker_pid(launcher_pid: int, local_rank: int) -> int | None:
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
