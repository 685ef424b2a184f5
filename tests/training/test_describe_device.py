"""The start-up line's parameter counts are summed on the compute device: an NCCL group carries CUDA tensors only,
so counts made on the CPU would stop every run with TP, PP or EP > 1 at start-up. The groups here refuse CPU
tensors as NCCL's do (tests/helpers.py's ``meta_only_world``), and the compute device is "meta"."""

from __future__ import annotations

import pytest
import torch

from megalite.training.trainer import parameter_counts

from ..helpers import meta_only_world

META = torch.device("meta")


def _parameters():
    dense = torch.nn.Parameter(torch.empty(8, 4, device=META))
    expert = torch.nn.Parameter(torch.empty(6, 4, device=META))
    expert.is_expert = True
    return [dense, expert]


def test_parameter_counts_are_summed_on_the_compute_device():
    with meta_only_world(4, tp=2, ep=2):   # model-parallel group of 2 (TP), expert group of 2 (EP over DP 2)
        dense, routed = parameter_counts(_parameters(), META)
        assert dense.device == routed.device == META


def test_the_groups_refuse_cpu_tensors_as_nccl_does():
    """What makes the test above mean something: a CPU tensor in these groups' collectives raises."""
    with meta_only_world(4, tp=2, ep=2):
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            parameter_counts(_parameters(), torch.device("cpu"))
