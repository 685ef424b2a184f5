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


DEFAULT_WORLD = 4


def pytest_collection_modifyitems(config, items):
    """Each test runs in the launch whose size its ``world`` marker names (default 4) and is skipped in others."""
    actual = int(os.environ.get("WORLD_SIZE", "0"))
    for item in items:
        marker = item.get_closest_marker("world")
        wanted = marker.args[0] if marker else DEFAULT_WORLD
        if actual == 0:
            item.add_marker(pytest.mark.skip(reason="distributed test: run under torchrun (tests/run.sh)"))
        elif actual != wanted:
            item.add_marker(pytest.mark.skip(reason=f"runs in the launch of {wanted} ranks"))


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


def requires_world(size: int):
    """Run the test in the launch of this many ranks (tests/run.sh starts one of 4 and one of 8)."""
    return pytest.mark.world(size)
