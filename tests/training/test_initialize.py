"""Which backend and device a process gets (--distributed-backend and the node's GPUs), the one-line error when a
node has more processes than GPUs, before any process group exists, and the device's numerics settings (TF32 for fp32
products on CUDA only), and the --save directory's lock taken by rank 0 at start-up."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megalite.checkpoint import CheckpointError
from megalite.checkpoint.lock import Owner, SaveLock
from megalite.config import CheckpointConfig, ConfigError
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


def test_rank_0_takes_the_save_lock_and_every_rank_learns_the_outcome(tmp_path, monkeypatch):
    """Before any process group: rank 0 takes --save's lock and says through torchrun's key-value store whether it
    got it; another rank goes on, or raises rank 0's refusal (the same line), or says rank 0 never answered."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)   # torchrun's agent store
    for name, value in [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(store.port)), ("WORLD_SIZE", "2"),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True"), ("TORCHELASTIC_RESTART_COUNT", "0")]:
        monkeypatch.setenv(name, value)
    c = CheckpointConfig(save=str(tmp_path))

    def as_rank(rank: int, timeout_s: float = 10):
        monkeypatch.setenv("RANK", str(rank))
        return initialize.take_save_lock(c, timeout_s)

    lock = as_rank(0)
    assert lock is not None and as_rank(1) is None
    lock.release()
    SaveLock.acquire(tmp_path, owner=Owner("node7", 4242, "other"))   # another job's, on another node
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")             # each attempt has its own answer
    refusals = []
    for rank in (0, 1):
        with pytest.raises(CheckpointError, match=r"in use by another job \(host node7, pid 4242") as refused:
            as_rank(rank)
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")             # rank 0 failed an earlier check: no answer
    with pytest.raises(ConfigError, match=rf"rank 0 did not say within 1 s whether it holds the lock of --save "
                                          rf"{tmp_path} \("):
        as_rank(1, timeout_s=1)
