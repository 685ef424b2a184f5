"""A world of N ranks simulated in one process: torch's fake process group, for the meta device only.

torch's ``FakeProcessGroup`` (the one behind torchtitan's comm mode) completes every collective at once and moves no
data. It is registered here as the backend ``megalite-sim`` for the ``meta`` device alone, the simulated GPUs'
memory: a collective handed a CPU tensor fails as it would under NCCL ("No backend type associated with device type
cpu"); megalite.simulation.communication names the caller first and coalesces batched sends and receives into one
Work, as NCCL does.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator

import torch.distributed as dist

BACKEND = "megalite-sim"


def _create_backend(common_options, backend_options):
    from torch._C._distributed_c10d import FakeProcessGroup   # noqa: PLC0415 - torch's own
    if hasattr(FakeProcessGroup, "_create_internal"):   # torch 2.8 and newer; older ones construct it directly
        return FakeProcessGroup._create_internal(common_options.group_rank, common_options.group_size,
                                                 backend_options)
    return FakeProcessGroup(common_options.group_rank, common_options.group_size)


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int) -> Iterator[None]:
    """torch.distributed initialized as rank ``rank`` of ``world_size`` simulated ranks inside the block."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=["meta"])
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized: a simulated world needs a process of its own")
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=1))
    try:
        yield
    finally:
        dist.destroy_process_group()
