"""This rank's pipeline: what it derives from the options and the layout (on a simulated world of 16 ranks, this
process its rank 0)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megalite import parallel_state
from megalite.config.dims import ParallelDims
from megalite.pipeline import Pipeline
from megalite.simulation.world import simulated_world

from ..helpers import tiny_config


@contextlib.contextmanager
def registered(cfg, world: int = 16):
    p = cfg.parallel
    with simulated_world(world, 0):
        parallel_state.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                                 context_parallel_size=p.context_parallel_size)
        try:
            yield ParallelDims.of(p, world)
        finally:
            parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("sequence_parallel, tokens", [(False, 32 // 2), (True, 32 // 2 // 2)])
def test_messages_carry_this_rank_s_context_and_sequence_parallel_share(sequence_parallel, tokens):
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4}, training={"micro_batch_size": 3, "global_batch_size": 12},
                      parallel={"context_parallel_size": 2, "sequence_parallel": sequence_parallel})
    with registered(cfg) as dims:
        pipeline = Pipeline(cfg, dims, torch.bfloat16, torch.device("meta"))
        assert pipeline.links.shape == (3, tokens, 64) and pipeline.links.dtype == torch.bfloat16
        assert (pipeline.pp, pipeline.rank, pipeline.loss_rank, pipeline.weight_grads) == (2, 0, 1, None)


def test_zbv_places_the_loss_on_the_first_rank_and_defers_weight_gradients():
    cfg = tiny_config(pp=2, model={"num_layers": 4}, parallel={"pipeline_schedule": "zbv"})
    with registered(cfg, 4) as dims:
        pipeline = Pipeline(cfg, dims, torch.float32, torch.device("meta"))
        assert pipeline.loss_rank == 0 and pipeline.weight_grads is not None
        assert [c.first_layer for c in pipeline.chunks] == [0, 3]
        assert pipeline.plans(4) is pipeline.plans(4)   # built once per number of micro-batches


def test_one_rank_has_no_links_and_no_pipelining():
    cfg = tiny_config(parallel={"pipeline_schedule": "zbv"})
    with registered(cfg, 1) as dims:
        pipeline = Pipeline(cfg, dims, torch.float32, torch.device("meta"))
        assert pipeline.links is None and pipeline.schedule_name == "1f1b" and pipeline.weight_grads is None
