"""ZeRO-3 with --offload-params keeps parameter and gradient shards on the CPU, while its groups (NCCL's) carry GPU
tensors only: what megalite gathers of those shards itself goes to the compute device first (the sums:
tests/distributed/test_finalize.py). The groups here refuse CPU tensors as NCCL's do and carry "meta" tensors, the
compute device (tests/helpers.py's ``meta_only_world``)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from megalite import parallel_state
from megalite.distributed import full_local_tensor

from ..helpers import meta_only_world

META = torch.device("meta")


def test_an_offloaded_shard_is_gathered_on_the_mesh_device():
    with meta_only_world(2):
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        mesh = DeviceMesh.from_group(group.group, "meta", mesh_dim_names=(f"offload_{group.group.group_name}",))
        shape = torch.Size([4, 3])   # rows 0-1 on this rank, on the CPU as FSDP2's CPUOffloadPolicy keeps them
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(shape, (3, 1), torch.float32))
        offloaded = DTensor(torch.ones(2, 3), spec, requires_grad=False)
        full = full_local_tensor(offloaded)
        assert full.device == META and full.shape == shape
