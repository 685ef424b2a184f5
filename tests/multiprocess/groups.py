"""Layouts for distributed tests: build one over some ranks of the launch (the single-process reference is
tests/helpers.py's ``single_layout``)."""

from __future__ import annotations

import contextlib

import pytest

from megalite import parallel_state


@contextlib.contextmanager
def layout(tp: int = 1, pp: int = 1, ranks=None, cp: int = 1, ep: int = 1, etp=None, instances: int = 1):
    """Build a layout over ``ranks`` (default: the world); yields True on member ranks, False elsewhere.

    Its groups inherit the world's short test timeout (see lockstep.py)."""
    state = parallel_state.initialize_model_parallel(tp, pp, ranks, context_parallel_size=cp,
                                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                                     num_distributed_optimizer_instances=instances)
    try:
        yield state is not None
    finally:
        parallel_state.destroy_model_parallel()


def requires_world(size: int):
    """Run the test in the launch of this many ranks (tests/run.sh starts one of 4 and one of 8)."""
    return pytest.mark.world(size)
