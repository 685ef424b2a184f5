"""Both data-parallel engines implement the whole contract: no method falls through to the Protocol's empty body."""

from __future__ import annotations

import pytest

from megalite.distributed import DataParallel, DataParallelEngine, FullyShardedDataParallel

CONTRACT = [name for name, value in vars(DataParallelEngine).items() if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("engine", [DataParallel, FullyShardedDataParallel])
def test_every_method_of_the_contract_is_the_engine_s_own(engine):
    assert len(CONTRACT) == 8
    assert [name for name in CONTRACT if getattr(engine, name) is getattr(DataParallelEngine, name)] == []
