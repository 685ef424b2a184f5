"""Fixtures of the planner's tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megalite.tensor_parallel import mappings


@pytest.fixture
def local_collectives(monkeypatch):
    """Shape-correct stand-ins for the TP collectives, so a TP > 1 forward runs in one process (the values are
    wrong, the shapes, hence the bytes autograd keeps, are right)."""
    def all_gather(parts, x, group=None):
        for part in parts:
            part.copy_(x)

    monkeypatch.setattr(dist, "all_reduce", lambda x, *args, **kwargs: None)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(mappings, "_reduce_scatter_flat", lambda out, x, *args, **kwargs: out.copy_(x[: len(out)]))
