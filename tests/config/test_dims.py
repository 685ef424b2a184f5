"""megalite.config.dims: the layout's sizes at a world size, the one place they are computed."""

from __future__ import annotations

import pytest

from megalite.config import ConfigError
from megalite.config.dims import ParallelDims
from megalite.config.schema import ParallelConfig


def test_sizes_follow_megatrons_layout():
    # 32 ranks: TP 2 x CP 2 x PP 2 leaves DP 4; EP 4 is carved from DP x CP = 8, leaving 2 expert replicas.
    dims = ParallelDims.of(ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2,
                                          pipeline_model_parallel_size=2, expert_model_parallel_size=4), 32)
    assert (dims.model_parallel, dims.dp, dims.dp_cp, dims.expert_dp, dims.expert_tp) == (8, 4, 8, 2, 2)
    assert dims.micro_batches(64, 2) == 8   # 64 / (micro 2 x DP 4): CP ranks share their replica's samples
    assert ParallelDims(8, tp=2, etp=1).expert_tp == 1


def test_a_world_that_is_not_whole_replicas_or_a_size_below_one_is_one_line():
    with pytest.raises(ConfigError) as info:
        ParallelDims(6, tp=2, cp=2).check()
    assert str(info.value) == ("world size 6 is not divisible by --tensor-model-parallel-size 2 x "
                               "--context-parallel-size 2 x --pipeline-model-parallel-size 1 = 4")
    with pytest.raises(ConfigError, match="^--pipeline-model-parallel-size must be >= 1, got 0$"):
        ParallelDims.of(ParallelConfig(pipeline_model_parallel_size=0), 4)
