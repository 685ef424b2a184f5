"""End to end: training at TP=2, TP=4, DP=2, TP=2 x DP=2 and DP=4 gives the single-process losses.

Same seed and global batch, dropout off, fp32: 10 iterations, per-iteration loss and gradient norm within 1e-5
relative. The initial weights are compared too (gathered over TP), since layout independence starts there.
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
from .conftest import layout, single_process

RTOL = 1e-5
CPU = torch.device("cpu")


def _reference(cfg):
    with single_process():
        return Trainer(dataclasses.replace(cfg, parallel=ParallelConfig()), CPU).train()


def _full_parameters(model) -> dict[str, torch.Tensor]:
    info = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, param in model.canonical_named_parameters():
        parts = [param.detach()]
        if info.size > 1 and param.partition.is_sharded:
            parts = [torch.empty_like(param) for _ in range(info.size)]
            dist.all_gather(parts, param.detach().contiguous(), group=info.group)
        full[name] = unshard(parts, param.partition, param.full_shape[param.partition.dim]
                             if param.partition.is_sharded else None)
    return full


@pytest.mark.parametrize("tp, ranks, micro_batch_size", [
    (2, None, 2),          # TP=2 x DP=2
    (4, None, 2),          # TP=4
    (1, [0, 1], 2),        # DP=2
    (1, None, 1),          # DP=4 with smaller micro-batches (more accumulation steps)
    (2, [0, 1], 1),        # TP=2 alone
])
def test_losses_match_single_process(tp, ranks, micro_batch_size):
    cfg = tiny_config(tp=tp, training={"micro_batch_size": micro_batch_size})
    expected = _reference(cfg)
    with layout(tp, ranks=ranks) as member:
        if not member:
            return
        records = Trainer(cfg, CPU).train()
    assert len(records) == 10
    loss_diff = max_relative_difference([r["loss"] for r in records], [r["loss"] for r in expected])
    norm_diff = max_relative_difference([r["grad_norm"] for r in records], [r["grad_norm"] for r in expected])
    print(f"tp={tp} ranks={ranks} mbs={micro_batch_size}: max rel loss diff {loss_diff:.2e}, "
          f"grad norm diff {norm_diff:.2e}")
    assert loss_diff < RTOL
    assert norm_diff < RTOL
    assert records[-1]["loss"] < records[0]["loss"]   # it learns


@pytest.mark.parametrize("untie", [False, True])
def test_initial_weights_are_layout_independent(untie):
    cfg = tiny_config(tp=4, model={"untie_embeddings_and_output_weights": untie})
    with single_process():
        expected = _full_parameters(Trainer(cfg, CPU).model)
    with layout(4):
        actual = _full_parameters(Trainer(cfg, CPU).model)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_bf16_stays_close_to_fp32():
    cfg = tiny_config(tp=2, training={"bf16": True, "train_iters": 20})
    with single_process():
        fp32 = Trainer(tiny_config(training={"train_iters": 20}), CPU).train()
    with layout(2):
        bf16 = Trainer(cfg, CPU).train()
    assert abs(bf16[-1]["loss"] - fp32[-1]["loss"]) / fp32[-1]["loss"] < 0.02
