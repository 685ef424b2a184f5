"""Distributed tests run as one pytest process per rank under a single torchrun launch (see tests/run.sh).

The world is joined once per session; each test builds the layout it needs with ``layout(...)`` and tears it down,
so many layouts share one (slow) launch. A collective timeout of 60 s turns a mismatch between ranks into a failure
instead of a hang. Outside torchrun these tests are skipped.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from megalite import parallel_state


def pytest_collection_modifyitems(config, items):
    if "WORLD_SIZE" not in os.environ:
        skip = pytest.mark.skip(reason="distributed test: run under torchrun (tests/run.sh)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def world():
    if "WORLD_SIZE" not in os.environ:
        yield
        return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)   # 4 ranks on 2 cores: more threads only fight each other
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_layout():
    yield
    parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def layout(tp: int = 1, pp: int = 1, ranks=None):
    """Build a layout over ``ranks`` (default: the world); yields True on member ranks, False elsewhere."""
    state = parallel_state.initialize_model_parallel(tp, pp, ranks)
    try:
        yield state is not None
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def single_process():
    """The reference: a 1x1x1 layout on this rank alone (no communication at all)."""
    with layout(1, 1, ranks=[dist.get_rank()]):
        yield


def world_size() -> int:
    return dist.get_world_size()
