"""Comparing a parallel training run with the single-process run of the same configuration.

``check_against_reference`` trains both (10 iterations by default) and asserts per-iteration losses and gradient norms
within 1e-5 relative and final weights within 1e-5 absolute (gathered over TP, compared by canonical name); for a
mixture of experts also each MoE layer's per-iteration metrics (balancing losses, expert loads, dropped tokens); with
multi-token prediction its per-iteration losses.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import ParallelConfig
from megalite.config.batches import batch_schedule, train_iterations
from megalite.distributed import full_local_tensor
from megalite.tensor_parallel import unshard
from megalite.training import Trainer

from ..helpers import max_relative_difference, single_layout
from .groups import layout

RTOL = 1e-5
CPU = torch.device("cpu")


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters by canonical name, each gathered over TP and stripped of vocabulary padding."""
    info = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, param in trainer.canonical_named_parameters():
        local = full_local_tensor(param)   # a ZeRO-3 shard gathered over DP first
        parts = [local]
        if info.size > 1 and param.partition.is_sharded:
            parts = [torch.empty_like(local) for _ in range(info.size)]
            dist.all_gather(parts, local.contiguous(), group=info.group)
        size = param.full_shape[param.partition.dim] if param.partition.is_sharded else None
        full[name] = unshard(parts, param.partition, size)
    return full


def train(cfg, ranks=None, inspect=None):
    """(records, final full parameters) on member ranks, None elsewhere; ``inspect(trainer)`` runs after training,
    inside the layout."""
    p = cfg.parallel
    with layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, ranks=ranks,
                cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                etp=p.expert_tensor_parallel_size, instances=p.num_distributed_optimizer_instances) as member:
        if not member:
            return None
        trainer = Trainer.on_registered_layout(cfg, CPU)
        records = trainer.train()
        if inspect is not None:
            inspect(trainer)
        return records, full_parameters(trainer)


_REFERENCES: dict[str, tuple] = {}   # reference runs by configuration: layouts of one model share one run


def resumed_losses(cfg, tp: int, pp: int, ranks, iteration: int, ep: int = 1):
    """The losses of ``cfg`` resumed (its --load holds iteration ``iteration``) at TP x PP (x EP) over ``ranks``;
    None on ranks outside the layout."""
    with layout(tp, pp, ranks=ranks, ep=ep) as member:
        if not member:
            return None
        trainer = Trainer.on_registered_layout(cfg, CPU)
        assert trainer.state.iteration == iteration
        return [r["loss"] for r in trainer.train() if "loss" in r]


def reference(cfg):
    """The single-process run: no parallelism, and the plain (unsharded, unoverlapped, on-device) optimizer (and no
    token dispatch to choose), its layers eager (compiled ones are compared with them). Runs once per configuration
    and launch: tests comparing several layouts of one configuration share it."""
    optimizer = dataclasses.replace(cfg.optimizer, use_distributed_optimizer=False, zero_stage=1,
                                    overlap_grad_reduce=False, overlap_param_gather=False,
                                    optimizer_cpu_offload=False, offload_params=False, ddp_bucket_size=None,
                                    muon_tp_mode="duplicated")   # how TP shards are orthogonalized: none at TP=1
    model = dataclasses.replace(cfg.model, moe_token_dispatcher_type="alltoall")
    kernels = dataclasses.replace(cfg.kernels, torch_compile=False)
    cfg = dataclasses.replace(cfg, model=model, parallel=ParallelConfig(), optimizer=optimizer, kernels=kernels)
    if repr(cfg) not in _REFERENCES:
        with single_layout():
            trainer = Trainer.on_registered_layout(cfg, CPU)
            _REFERENCES[repr(cfg)] = trainer.train(), full_parameters(trainer)
    return _REFERENCES[repr(cfg)]


def _moe_metrics_difference(records, expected_records) -> float:
    """The largest relative difference of the MoE layers' per-iteration metrics (losses, loads, dropped tokens)."""
    keys = [key for key in expected_records[0] if key.startswith("moe_")]
    assert keys == [key for key in records[0] if key.startswith("moe_")]
    return max((max_relative_difference(r[key], e[key]) for r, e in zip(records, expected_records) for key in keys),
               default=0.0)


def check_against_reference(cfg, ranks=None, label="") -> list[dict] | None:
    """The comparison (see the module docstring); the parallel run's training records on member ranks."""
    # Adam divides by sqrt(v) + eps: for the few weights whose gradients are ~1e-9 (dead GeLU units), eps=1e-8 turns
    # last-bit summation differences into O(lr) updates (measured 4e-5 abs at TP=2). eps=1e-5 keeps the update a
    # smooth function of the gradient, so the weights compare at the precision of the arithmetic (~1e-7).
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, adam_eps=1e-5))
    expected_records, expected_params = reference(cfg)
    result = train(cfg, ranks)
    if result is None:
        return
    records, params = result
    evaluations = [r["eval_loss"] for r in records if "eval_loss" in r]
    expected_evaluations = [r["eval_loss"] for r in expected_records if "eval_loss" in r]
    records = [r for r in records if "loss" in r]
    expected_records = [r for r in expected_records if "loss" in r]
    assert len(records) == len(expected_records) == train_iterations(cfg.training, batch_schedule(
        cfg.training, cfg.model.seq_length))
    assert len(evaluations) == len(expected_evaluations) == 2    # every 5 iterations, forward-only schedule
    eval_diff = max_relative_difference(evaluations, expected_evaluations)
    loss_diff = max_relative_difference([r["loss"] for r in records], [r["loss"] for r in expected_records])
    norm_diff = max_relative_difference([r["grad_norm"] for r in records], [r["grad_norm"] for r in expected_records])
    weight_diff, worst = max((float((params[n] - expected_params[n]).abs().max()), n) for n in params)
    moe_diff = _moe_metrics_difference(records, expected_records)
    mtp_diff = max((max_relative_difference([r[key]] if key == "mtp_loss" else r[key], [e[key]] if key == "mtp_loss"
                                            else e[key]) for r, e in zip(records, expected_records)
                    for key in ("mtp_loss", "mtp_losses") if key in e), default=0.0)
    assert all(("mtp_loss" in r) == ("mtp_loss" in e) for r, e in zip(records, expected_records))
    print(f"{label}: max rel loss diff {loss_diff:.2e}, eval loss diff {eval_diff:.2e}, grad norm diff {norm_diff:.2e}, "
          f"max abs weight diff {weight_diff:.2e} ({worst})" + (f", moe metrics diff {moe_diff:.2e}" if moe_diff else "")
          + (f", mtp loss diff {mtp_diff:.2e}" if "mtp_loss" in expected_records[0] else ""))
    assert loss_diff < RTOL and eval_diff < RTOL and mtp_diff < RTOL
    assert moe_diff < RTOL
    assert norm_diff < RTOL
    assert weight_diff < RTOL
    assert records[-1]["loss"] < records[0]["loss"]   # it learns
    return records
