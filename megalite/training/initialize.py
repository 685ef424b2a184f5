"""Starting the processes' world: backend and device chosen from the hardware, then the layout's groups.

NCCL on GPUs (one per local rank), gloo on CPUs. Without torchrun's environment there is no world to join: a single
process runs with a 1x1x1 layout and no torch.distributed at all.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import ParallelConfig


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


def allow_tf32(device: torch.device) -> bool:
    """On a CUDA device, let fp32 matmuls and cuDNN round their inputs to TF32 on the tensor cores (as Megatron and
    torchtitan do; 8x the fp32 rate on A100/H100; the bf16/fp16 products are unaffected): whether it did. Elsewhere
    nothing changes."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def initialize_distributed(parallel: ParallelConfig, timeout_s: float = 600.0) -> torch.device:
    """Join the world (when launched by torchrun), build the layout's groups, and return this rank's device.

    ``timeout_s`` bounds every collective: a rank that died or stalls makes the others raise instead of hanging."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    allow_tf32(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        # torchrun --max-restarts keeps its key-value store across restarts; sub-groups (TP, DP, ...) publish their
        # addresses there under names that repeat from one attempt to the next, so a restarted rank would dial a dead
        # peer. A per-attempt prefix keeps every attempt's keys apart.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"megalite/attempt{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    parallel_state.initialize_model_parallel(parallel.tensor_model_parallel_size,
                                             parallel.pipeline_model_parallel_size, timeout=timeout,
                                             context_parallel_size=parallel.context_parallel_size,
                                             expert_model_parallel_size=parallel.expert_model_parallel_size,
                                             expert_tensor_parallel_size=parallel.expert_tensor_parallel_size)
    return device


def shutdown_distributed(wait_for_peers: bool = False) -> None:
    """Tear the groups down. ``wait_for_peers`` (after a successful run only: a dead peer would make it wait for the
    timeout) first lets every rank finish its last collectives, so no rank destroys a group a peer still uses."""
    if wait_for_peers and dist.is_initialized():
        dist.barrier()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
