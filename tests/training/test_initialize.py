"""Which backend and device a process gets (--distributed-backend and the node's GPUs), the one-line error when a
node has more processes than GPUs, before any process group exists, and the device's numerics settings (TF32 for fp32
products on CUDA only)."""

from __future__ import annotations

import pytest
import torch

import pretrain_gpt
from megalite.config import ConfigError
from megalite.training import initialize

CPU = torch.device("cpu")


def test_nccl_puts_each_local_rank_on_its_gpu():
    assert initialize.choose_device("nccl", 3, gpu_count=4, local_world_size=4) == ("nccl", torch.device("cuda", 3))


def test_gloo_runs_on_the_cpu_even_beside_gpus_and_nccl_without_gpus_falls_back_to_it():
    assert initialize.choose_device("gloo", 3, gpu_count=4, local_world_size=4) == ("gloo", CPU)
    assert initialize.choose_device("gloo", 5, gpu_count=4, local_world_size=8) == ("gloo", CPU)
    assert initialize.choose_device("nccl", 5, gpu_count=0, local_world_size=8) == ("gloo", CPU)


@pytest.mark.parametrize("local_rank", [0, 5])   # every process of the node says so, not only those past the GPUs
def test_more_processes_than_gpus_is_refused_by_every_process_of_the_node(local_rank):
    with pytest.raises(ConfigError, match=rf"LOCAL_RANK {local_rank} of 8 processes on this node, but it has 4 GPUs: "
                                          r"launch at most 4 processes per node \(--nproc_per_node\), or "
                                          r"--distributed-backend gloo to run on CPU ranks"):
        initialize.choose_device("nccl", local_rank, gpu_count=4, local_world_size=8)
    with pytest.raises(ConfigError, match="LOCAL_RANK 1 of 2 processes on this node, but it has 1 GPU: "):
        initialize.choose_device("nccl", 1, gpu_count=1)   # no LOCAL_WORLD_SIZE: at least LOCAL_RANK + 1


def test_pretrain_gpt_says_so_in_one_line_before_any_process_group(monkeypatch, capsys):
    """A node of 4 GPUs (as torch sees it) and LOCAL_RANK 5: exit code 2 and one line, not "invalid device
    ordinal" from inside CUDA; the process group is never started."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(pretrain_gpt, "initialize_distributed", lambda *a, **k: pytest.fail("started the world"))
    assert pretrain_gpt.main(["model=gpt_tiny", "--train-iters", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megalite: error: LOCAL_RANK 5 of 8 processes on this node, but it has 4 GPUs") and \
        "\n" not in err


def test_the_backend_is_nccl_or_gloo(capsys):
    assert pretrain_gpt.main(["model=gpt_tiny", "--distributed-backend", "mpi"]) == 2
    assert "megalite: error: --distributed-backend must be nccl or gloo, got 'mpi'" in capsys.readouterr().err


def test_tf32_is_allowed_on_cuda_only():
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert not initialize.allow_tf32(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert initialize.allow_tf32(torch.device("cuda", 0))   # a device object needs no GPU
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
