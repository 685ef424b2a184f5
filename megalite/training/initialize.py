"""Starting the processes' world: backend and device chosen from --distributed-backend and the hardware, then the
layout's groups.

NCCL on GPUs (one per local rank), gloo on CPUs: by default NCCL, or gloo on a machine without CUDA; with
``--distributed-backend gloo`` every rank runs on the CPU even beside GPUs. Without torchrun's environment there is
no world to join: a single process runs with a 1x1x1 layout and no torch.distributed at all.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.lock import SaveLock
from megalite.config import CheckpointConfig, ConfigError, ParallelConfig
from megalite.config.flags import FLAG
from megalite.training.failures import nccl_flight_recorder_defaults


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def finish_checks(failed: bool, timeout_s: float = 30.0) -> None:
    """Say this rank ran its start-up checks; one that failed them waits (at most ``timeout_s``) for every rank to run
    them, so each prints its own error line before torchrun, stopping all ranks once one exits, silences a peer."""
    world = world_size_from_env()
    if world <= 1 or "MASTER_ADDR" not in os.environ:
        return
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
        key = f"megalite/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/checked"
        arrived, deadline = store.add(key, 1), time.monotonic() + timeout_s
        while failed and arrived < world and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(key, 0)
    except (RuntimeError, ValueError, TimeoutError):   # no store to reach: nothing to wait for
        pass


def take_save_lock(c: CheckpointConfig, timeout_s: float = 600.0) -> Optional[SaveLock]:
    """Rank 0 takes the lock of ``--save`` (megalite.checkpoint.lock: one job per directory) before any process
    group exists and tells every rank through torchrun's key-value store whether it got it, so that a refusal is
    the same one-line CheckpointError on every rank, before any collective. Rank 0 returns the lock (the caller
    releases it at exit), the other ranks None; rank 0 prints a line when it took over a dead owner's lock. The
    others wait at most ``timeout_s`` (the collective timeout) for rank 0's answer."""
    rank, world = int(os.environ.get("RANK", "0")), world_size_from_env()
    store = None
    if world > 1 and "MASTER_ADDR" in os.environ:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    key = f"megalite/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/save_lock"
    if rank != 0:
        if store is None:
            return None
        try:
            refusal = store.get(key).decode()
        except (RuntimeError, TimeoutError) as error:   # rank 0 failed before (its own line says why) or stalls
            raise ConfigError(f"rank 0 did not say within {timeout_s:g} s whether it holds the lock of "
                              f"{FLAG.save} {c.save} ({str(error).splitlines()[0]})") from None
        if refusal:
            raise CheckpointError(refusal)
        return None
    try:
        lock, line = SaveLock.acquire(c.save, c.break_save_lock)
    except CheckpointError as error:
        if store is not None:
            store.set(key, str(error))
        raise
    if store is not None:
        store.set(key, "")
    if line:
        print(line, flush=True)
    return lock


def choose_device(backend: str, local_rank: int, gpu_count: int,
                  local_world_size: int = 1) -> tuple[str, torch.device]:
    """(backend, device) of the process ``local_rank`` of ``local_world_size`` on a node with ``gpu_count`` GPUs, for
    --distributed-backend ``backend``: NCCL on GPU ``local_rank``, or gloo on the CPU (asked for, or no GPU at all).
    A ConfigError when NCCL would need more GPUs than the node has (every process of the node says so alike)."""
    if backend == "gloo" or gpu_count == 0:
        return "gloo", torch.device("cpu")
    processes = max(local_world_size, local_rank + 1)
    if processes > gpu_count:
        raise ConfigError(f"LOCAL_RANK {local_rank} of {processes} processes on this node, but it has {gpu_count} "
                          f"GPU{'s' if gpu_count > 1 else ''}: launch at most {gpu_count} processes per node "
                          f"(--nproc_per_node), or {FLAG.distributed_backend} gloo to run on CPU ranks")
    return "nccl", torch.device("cuda", local_rank)


def rank_device(backend: str) -> tuple[str, torch.device]:
    """:func:`choose_device` for this process, from torchrun's environment and the visible GPUs."""
    return choose_device(backend, int(os.environ.get("LOCAL_RANK", "0")),
                         torch.cuda.device_count() if torch.cuda.is_available() else 0,
                         int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def allow_tf32(device: torch.device) -> bool:
    """On a CUDA device, let fp32 matmuls and cuDNN round their inputs to TF32 on the tensor cores (as Megatron and
    torchtitan do; 8x the fp32 rate on A100/H100; the bf16/fp16 products are unaffected): whether it did. Elsewhere
    nothing changes."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def initialize_distributed(parallel: ParallelConfig, timeout_s: float = 600.0,
                           backend: str = "nccl") -> torch.device:
    """Join the world (when launched by torchrun) over ``backend`` (--distributed-backend, see
    :func:`choose_device`), build the layout's groups, and return this rank's device.

    ``timeout_s`` bounds every collective: a rank that died or stalls makes the others raise instead of hanging."""
    backend, device = rank_device(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    allow_tf32(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        # torchrun --max-restarts keeps its key-value store across restarts; sub-groups (TP, DP, ...) publish their
        # addresses there under names that repeat from one attempt to the next, so a restarted rank would dial a dead
        # peer. A per-attempt prefix keeps every attempt's keys apart.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"megalite/attempt{attempt}", store)
        if backend == "nccl":   # read when the NCCL group is made: a timeout then leaves each rank's last collectives
            nccl_flight_recorder_defaults(os.environ)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    parallel_state.initialize_model_parallel(parallel.tensor_model_parallel_size,
                                             parallel.pipeline_model_parallel_size, timeout=timeout,
                                             context_parallel_size=parallel.context_parallel_size,
                                             expert_model_parallel_size=parallel.expert_model_parallel_size,
                                             expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
                                             num_distributed_optimizer_instances=(
                                                 parallel.num_distributed_optimizer_instances))
    return device


def shutdown_distributed(wait_for_peers: bool = False) -> None:
    """Tear the groups down. ``wait_for_peers`` (after a successful run only: a dead peer would make it wait for the
    timeout) first lets every rank finish its last collectives, so no rank destroys a group a peer still uses."""
    if wait_for_peers and dist.is_initialized():
        dist.barrier()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
