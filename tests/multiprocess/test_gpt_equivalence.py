"""End to end: every parallel layout trains exactly like the single process.

Same seed and global batch, dropout off, fp32: 10 iterations, per-iteration loss and gradient norm within 1e-5
relative, and the final weights (gathered over TP, compared per pipeline stage by canonical name) within 1e-5.
The initial weights are compared too, since layout independence starts there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import ParallelConfig
from megalite.training import Trainer

from ..helpers import single_layout, tiny_config
from .groups import layout, requires_world
from .equivalence import CPU, check_against_reference, full_parameters


@requires_world(4)
@pytest.mark.parametrize("tp, pp, v, ranks, micro_batch_size", [
    (2, 1, 1, None, 2),          # TP=2 x DP=2
    (4, 1, 1, None, 2),          # TP=4
    (1, 1, 1, [0, 1], 2),        # DP=2
    (1, 1, 1, None, 1),          # DP=4 with smaller micro-batches (more accumulation steps)
    (2, 1, 1, [0, 1], 1),        # TP=2 alone
    (1, 2, 1, None, 1),          # PP=2 x DP=2, 1F1B
    (1, 4, 1, None, 1),          # PP=4, 1F1B
    (1, 2, 2, [0, 1], 1),        # PP=2, V=2: interleaved
    (2, 2, 1, None, 1),          # TP=2 x PP=2
])
def test_losses_and_weights_match_single_process(tp, pp, v, ranks, micro_batch_size):
    cfg = tiny_config(tp=tp, pp=pp, model={"num_layers": 4},
                      parallel={"num_virtual_stages_per_pipeline_rank": v if v > 1 else None},
                      training={"micro_batch_size": micro_batch_size})
    check_against_reference(cfg, ranks, f"tp={tp} pp={pp} v={v} ranks={ranks} mbs={micro_batch_size}")


@requires_world(8)
def test_three_dimensional_layout_matches_single_process():
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4}, training={"micro_batch_size": 1})
    check_against_reference(cfg, label="tp=2 pp=2 dp=2")


@requires_world(8)
def test_three_dimensional_interleaved_layout_matches_single_process():
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4}, parallel={"num_virtual_stages_per_pipeline_rank": 2},
                      training={"micro_batch_size": 1})
    check_against_reference(cfg, label="tp=2 pp=2 v=2 dp=2")


@requires_world(4)
def test_tied_embedding_copies_stay_identical_across_stages():
    cfg = tiny_config(pp=2, training={"micro_batch_size": 1, "train_iters": 5})
    with layout(1, 2, ranks=[0, 1]) as member:
        if not member:
            return
        trainer = Trainer(cfg, CPU)
        trainer.train()
        weights = trainer.tied_embedding_weights
        assert len(weights) == 1
        if parallel_state.is_pipeline_last_stage():
            assert getattr(weights[0], "is_embedding_copy", False)
        info = parallel_state.get_embedding_group()
        gathered = [torch.empty_like(weights[0]) for _ in range(info.size)]
        dist.all_gather(gathered, weights[0].detach(), group=info.group)
        assert torch.equal(gathered[0], gathered[1])


@requires_world(4)
@pytest.mark.parametrize("untie", [False, True])
def test_initial_weights_are_layout_independent(untie):
    cfg = tiny_config(tp=2, pp=2, model={"untie_embeddings_and_output_weights": untie})
    with single_layout():
        expected = full_parameters(Trainer(dataclasses.replace(cfg, parallel=ParallelConfig()), CPU))
    with layout(2, 2):
        actual = full_parameters(Trainer(cfg, CPU))
    assert actual.keys() <= expected.keys()
    for name in actual:
        assert torch.equal(actual[name], expected[name]), name


@requires_world(4)
def test_bf16_stays_close_to_fp32():
    cfg = tiny_config(tp=2, training={"bf16": True, "train_iters": 20})
    with single_layout():
        fp32 = Trainer(tiny_config(training={"train_iters": 20}), CPU).train()
    with layout(2):
        bf16 = Trainer(cfg, CPU).train()
    final = [[r for r in run if "loss" in r][-1]["loss"] for run in (bf16, fp32)]
    print(f"bf16 vs fp32 after 20 iterations: {final[0]:.5f} vs {final[1]:.5f} "
          f"({abs(final[0] - final[1]) / final[1]:.2%})")
    assert abs(final[0] - final[1]) / final[1] < 0.02
