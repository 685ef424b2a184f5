"""Dropout masks: different across TP ranks inside the tensor-parallel stream, equal in the default stream."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import parallel_state
from megalite.tensor_parallel import TensorParallelRNG

from .groups import layout


def _gather_over_tp(x: torch.Tensor) -> list[torch.Tensor]:
    info = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(info.size)]
    dist.all_gather(parts, x, group=info.group)
    return parts


def test_dropout_masks_differ_in_split_region_and_agree_in_replicated_region():
    with layout(tp=2):
        rng = TensorParallelRNG(seed=7, tp_rank=parallel_state.get_tensor_model_parallel_rank(), pp_rank=0,
                                device=torch.device("cpu"))
        with rng.fork():
            split_mask = F.dropout(torch.ones(256), p=0.5)
        replicated_mask = F.dropout(torch.ones(256), p=0.5)
        with rng.fork():   # the stream advances: a second fork draws a new mask
            second_split_mask = F.dropout(torch.ones(256), p=0.5)
        split = _gather_over_tp(split_mask)
        replicated = _gather_over_tp(replicated_mask)
        assert not torch.equal(split[0], split[1])
        assert torch.equal(replicated[0], replicated[1])
        assert not torch.equal(split_mask, second_split_mask)
