"""The global gradient norm's sums run on the groups' device (NCCL's: the GPU), wherever this rank's gradient
pieces are: on the CPU (--offload-params) or nowhere (a rank owning no piece). The groups here refuse CPU tensors as
NCCL's do and carry "meta" tensors (tests/helpers.py's ``meta_only_world``), so a sum that reaches the end can only
fail at reading its meta result."""

from __future__ import annotations

import pytest
import torch

from megalite.optimizer import global_grad_norm

from ..helpers import meta_only_world


@pytest.mark.parametrize("pieces", [[], "cpu"], ids=["no piece", "pieces on the CPU"])
def test_the_norm_is_summed_on_the_groups_device(pieces):
    if pieces == "cpu":
        param = torch.nn.Parameter(torch.ones(4, 3))
        pieces = [(param, torch.ones(12))]
    with meta_only_world(4, tp=2, ep=2):
        for sharded_over_data in (False, True):
            with pytest.raises(RuntimeError, match="meta tensors"):   # every sum ran; float() cannot read meta
                global_grad_norm(pieces, sharded_over_data)
