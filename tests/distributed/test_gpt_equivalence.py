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
from megalite.tensor_parallel import unshard
from megalite.training import Trainer

from ..helpers import max_relative_difference, tiny_config
from .conftest import layout, requires_world, single_process

RTOL = 1e-5
CPU = torch.device("cpu")


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters by canonical name, each gathered over TP and stripped of vocabulary padding."""
    info = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, param in trainer.canonical_named_parameters():
        parts = [param.detach()]
        if info.size > 1 and param.partition.is_sharded:
            parts = [torch.empty_like(param) for _ in range(info.size)]
            dist.all_gather(parts, param.detach().contiguous(), group=info.group)
        size = param.full_shape[param.partition.dim] if param.partition.is_sharded else None
        full[name] = unshard(parts, param.partition, size)
    return full


def train(cfg, ranks=None):
    """(records, final full parameters) on member ranks, None elsewhere."""
    p = cfg.parallel
    with layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, ranks=ranks) as member:
        if not member:
            return None
        trainer = Trainer(cfg, CPU)
        records = trainer.train()
        return records, full_parameters(trainer)


def reference(cfg):
    with single_process():
        trainer = Trainer(dataclasses.replace(cfg, parallel=ParallelConfig()), CPU)
        return trainer.train(), full_parameters(trainer)


def check_against_reference(cfg, ranks=None, label=""):
    # Adam divides by sqrt(v) + eps: for the few weights whose gradients are ~1e-9 (dead GeLU units), eps=1e-8 turns
    # last-bit summation differences into O(lr) updates (measured 4e-5 abs at TP=2). eps=1e-5 keeps the update a
    # smooth function of the gradient, so the weights compare at the precision of the arithmetic (~1e-7).
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, adam_eps=1e-5))
    expected_records, expected_params = reference(cfg)
    result = train(cfg, ranks)
    if result is None:
        return
    records, params = result
    assert len(records) == len(expected_records) == cfg.training.train_iters
    loss_diff = max_relative_difference([r["loss"] for r in records], [r["loss"] for r in expected_records])
    norm_diff = max_relative_difference([r["grad_norm"] for r in records], [r["grad_norm"] for r in expected_records])
    weight_diff, worst = max((float((params[n] - expected_params[n]).abs().max()), n) for n in params)
    print(f"{label}: max rel loss diff {loss_diff:.2e}, grad norm diff {norm_diff:.2e}, "
          f"max abs weight diff {weight_diff:.2e} ({worst})")
    assert loss_diff < RTOL
    assert norm_diff < RTOL
    assert weight_diff < RTOL
    assert records[-1]["loss"] < records[0]["loss"]   # it learns


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
    with single_process():
        expected = full_parameters(Trainer(dataclasses.replace(cfg, parallel=ParallelConfig()), CPU))
    with layout(2, 2):
        actual = full_parameters(Trainer(cfg, CPU))
    assert actual.keys() <= expected.keys()
    for name in actual:
        assert torch.equal(actual[name], expected[name]), name


@requires_world(4)
def test_bf16_stays_close_to_fp32():
    cfg = tiny_config(tp=2, training={"bf16": True, "train_iters": 20})
    with single_process():
        fp32 = Trainer(tiny_config(training={"train_iters": 20}), CPU).train()
    with layout(2):
        bf16 = Trainer(cfg, CPU).train()
    assert abs(bf16[-1]["loss"] - fp32[-1]["loss"]) / fp32[-1]["loss"] < 0.02
