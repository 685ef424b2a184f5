"""Starting the processes' world: backend and device chosen from the hardware, then the layout's groups.

NCCL on GPUs (one per local rank), gloo on CPUs. Without torchrun's environment there is no world to join: a single
process runs with a 1x1x1 layout and no torch.distributed at all.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import ParallelConfig


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize_distributed(parallel: ParallelConfig, timeout_s: float = 600.0) -> torch.device:
    """Join the world (when launched by torchrun), build the layout's groups, and return this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
    parallel_state.initialize_model_parallel(parallel.tensor_model_parallel_size,
                                             parallel.pipeline_model_parallel_size)
    return device


def shutdown_distributed() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
