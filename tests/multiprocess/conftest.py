"""Distributed tests run as one pytest process per rank under a single torchrun launch (see tests/run.sh).

The world is joined once per session; each test builds the layout it needs (``groups.layout``) and tears it down, so
many layouts share one (slow) launch. ``lockstep`` keeps the ranks in step: short collective timeouts, every test's
outcome agreed by all ranks (a failure on one rank fails the test on all and never strands the others), and a
watchdog that ends a launch which stops making progress. Outside torchrun these tests are skipped.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

from megalite import parallel_state

from .lockstep import Lockstep

DEFAULT_WORLD = 4
_LOCKSTEP: Lockstep | None = None


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


def pytest_sessionstart(session):
    global _LOCKSTEP
    if "WORLD_SIZE" in os.environ:
        torch.set_num_threads(1)   # 4-8 ranks on 2 cores: more threads only fight each other
        _LOCKSTEP = Lockstep(session.config)


def pytest_unconfigure(config):
    """After the terminal summary (pytest_sessionfinish comes before it)."""
    if _LOCKSTEP is not None:
        _LOCKSTEP.leave()


def pytest_runtest_logstart(nodeid, location):
    if _LOCKSTEP is not None:
        _LOCKSTEP.progress(nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if _LOCKSTEP is not None and call.when in ("setup", "call"):
        _LOCKSTEP.agree(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if _LOCKSTEP is not None and _LOCKSTEP.needs_rebuild:
        _LOCKSTEP.rebuild()


@pytest.fixture(autouse=True)
def clean_layout():
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture
def directory():
    """One temporary directory for every rank (rank 0 makes it and removes it; the ranks share one machine)."""
    holder = [tempfile.mkdtemp(prefix="megalite-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    yield holder[0]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(holder[0], ignore_errors=True)
