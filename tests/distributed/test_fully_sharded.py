"""ZeRO-3 with --offload-params keeps parameter and gradient shards on the CPU, while its groups (NCCL's) carry GPU
tensors only: what megalite sums or gathers of those shards itself goes to the compute device first. The groups here
refuse CPU tensors as NCCL's do and carry "meta" tensors, the compute device (tests/helpers.py's
``meta_only_world``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from megalite import parallel_state
from megalite.distributed import FullyShardedDataParallel, full_local_tensor

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


def _engine(group_kind: str) -> SimpleNamespace:
    """The parts of a FullyShardedDataParallel that finish_grad_sync reads: one CPU gradient shard to sum over the
    embedding group (a tied embedding) or the tensor group (a sequence-parallel parameter)."""
    param = SimpleNamespace(grad=SimpleNamespace(to_local=lambda: torch.ones(2, 3)))
    return SimpleNamespace(
        device=META,
        embedding_group=parallel_state.get_embedding_group() if group_kind == "embedding" else None,
        tied_params=[param] if group_kind == "embedding" else [],
        tensor_group=parallel_state.get_tensor_model_parallel_group() if group_kind == "tensor" else None,
        sequence_parallel_params=[param] if group_kind == "tensor" else [])


@pytest.mark.parametrize("group_kind", ["embedding", "tensor"])
def test_offloaded_gradients_are_summed_on_the_compute_device(group_kind):
    with meta_only_world(4, tp=2, pp=2):   # rank 0: the first stage, with an embedding group and a TP group of 2
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):   # the sum ran; the meta
            FullyShardedDataParallel.finish_grad_sync(_engine(group_kind))                # result has no values
