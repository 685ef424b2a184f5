"""The planner knows mixtures of experts: total and active parameters (the published numbers of Mixtral 8x7B and
Qwen3-30B-A3B), what each expert-parallel rank holds (against the real model and engines under a shape-only
layout), the experts' activations (against what autograd keeps), the all-to-all traffic and the active FLOPs; and
--dry-run and the out-of-memory doctor say so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pretrain_gpt
from megalite import parallel_state
from megalite.config import OptimizerConfig, TrainingConfig
from megalite.config.cli import parse_args
from megalite.distributed import DataParallel, EngineUnion, is_expert
from megalite.model import GPTModel
from megalite.model.flops import dense_macs_per_token_per_layer, model_flops_per_iteration
from megalite.optimizer import MegaliteOptimizer
from megalite.planner import Layout, Numerics, count_parameters, diagnose_out_of_memory, load_model_config
from megalite.planner import model_state_bytes, stage_memory
from megalite.planner.memory import _chunk_activation_bytes, expert_state_bytes
from megalite.planner.parameters import rank_tensors
from megalite.planner.performance import all_to_all_bytes

from ..helpers import TINY_MOE, tiny_config
from .test_memory import _measured_activations


def test_total_and_active_parameters_are_the_published_ones():
    mixtral = count_parameters(load_model_config("mixtral_8x7b"))
    assert (mixtral.total // 10**8, mixtral.active // 10**8) == (467, 128)   # 46.7B, 12.9B (12.88B)
    qwen = count_parameters(load_model_config("qwen3_30b_a3b"))
    assert (qwen.total // 10**8, qwen.active // 10**8) == (305, 33)          # 30.5B, 3.3B


def _moe_model(**options):
    return tiny_config(model={**TINY_MOE, "num_layers": 4, "moe_layer_freq": "[0,1,1,1]", **options}).model


@pytest.mark.parametrize("tp, ep, expert_tp", [(1, 2, None), (2, 2, None), (2, 4, 1)])
def test_an_expert_parallel_rank_holds_what_the_planner_counts(tp, ep, expert_tp):
    model = _moe_model(moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True, qk_layernorm=True)
    with parallel_state.simulated_layout(tp, 1, 4, ep=ep, etp=expert_tp), torch.device("meta"):
        real = list(GPTModel(model).canonical_named_parameters())
    planned = [t for chunk in rank_tensors(model, tp, 1, 1, 0, ep=ep, expert_tp=expert_tp) for t in chunk]
    strip = lambda name: name.split(".experts.")[0]   # noqa: E731 - expert indices: EP rank 0's
    assert [(strip(n), p.numel(), p.shape[0], is_expert(p)) for n, p in real] == \
        [(strip(t.name), t.numel, t.dim0, t.expert) for t in planned]
    assert count_parameters(model, tp, 1, 1, ep=ep, expert_tp=expert_tp).per_stage[0] == sum(p.numel() for _, p in real)


def _measured_states(model, layout: Layout, dtype: torch.dtype):
    """The trainer's engines (dense over DP, experts over DP / EP) and optimizer for DP rank 0 of the layout."""
    with parallel_state.simulated_layout(layout.tp, 1, layout.dp, ep=layout.ep):
        chunk = GPTModel(model).to(dtype)
        engines = [DataParallel([chunk], data_group=group, zero=layout.zero, select=select) for group, select in
                   [(parallel_state.get_data_parallel_group(), lambda p: not is_expert(p)),
                    (parallel_state.get_expert_data_parallel_group(), is_expert)]]
        optimizer = MegaliteOptimizer(EngineUnion(engines), OptimizerConfig(**OptimizerConfig.zero_settings(
            layout.zero)), TrainingConfig(bf16=dtype == torch.bfloat16))
        for piece in optimizer.pieces:
            piece.main.grad = torch.zeros_like(piece.main)
        optimizer.inner.step()
        weights = sum(e.param_buffer.untyped_storage().nbytes() for e in engines)
        grads = sum(sum(s.untyped_storage().nbytes() for s in e.grad_shards) if e.zero2
                    else e.grad_buffer.untyped_storage().nbytes() for e in engines)
        expert = engines[1]
        expert_grads = (sum(s.untyped_storage().nbytes() for s in expert.grad_shards) if expert.zero2
                        else expert.grad_buffer.untyped_storage().nbytes())
        expert_states = sum(t.numel() * t.element_size() for p in optimizer.pieces if is_expert(p.param)
                            for t in optimizer.inner.state[p.main].values() if t.dim() > 0)
        expert_states += sum(p.main.numel() * 4 for p in optimizer.pieces if is_expert(p.param) and not p.aliased)
        expert_bytes = expert.param_buffer.untyped_storage().nbytes() + expert_grads + expert_states
        return (weights, grads, optimizer.state_bytes()), expert_bytes


@pytest.mark.parametrize("layout", [Layout(dp=4, ep=2), Layout(dp=4, ep=2, zero=1), Layout(dp=4, ep=4, zero=2),
                                    Layout(tp=2, dp=2, ep=2, zero=1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_states_are_the_two_engines_buffers(layout, dtype):
    model = _moe_model()
    measured, measured_experts = _measured_states(model, layout, dtype)
    planned = model_state_bytes(model, layout, dtype_bytes=dtype.itemsize)
    for name, m, p in zip(("weights", "gradients", "optimizer"), measured,
                          (planned.weights, planned.gradients, planned.optimizer)):
        assert p == m, (layout.describe(), name, m, p)
    assert expert_state_bytes(model, layout, dtype_bytes=dtype.itemsize) == measured_experts


@pytest.mark.parametrize("tp, sp, options", [
    (1, False, {}),
    (1, False, {"swiglu": True, "moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": True}),
    (2, True, {"moe_router_load_balancing_type": "seq_aux_loss"}),
])
def test_moe_activations_are_what_autograd_keeps(local_collectives, tp, sp, options):
    model = dataclasses.replace(_moe_model(**options), num_layers=2, moe_layer_freq="[0,1]")
    measured = _measured_activations(model, tp, sp, True, True, 2)
    layout = Layout(tp=tp, sequence_parallel=sp, micro_batch_size=2)
    kept, _ = _chunk_activation_bytes(model, layout, model.num_layers, True, True, Numerics.cpu())
    print(f"MoE TP={tp} SP={sp} {options}: measured {measured}, planned {kept:.0f} (ratio {measured / kept:.4f})")
    assert abs(measured / kept - 1) < 0.15


def test_all_to_all_traffic_and_active_flops():
    model = _moe_model(moe_router_topk=2)
    tokens, h, p = 2 * model.seq_length, model.hidden_size, 2
    # Per MoE layer and micro-batch: 4 all-to-alls of k T rows, (EP - 1) / EP of them leaving the rank.
    assert all_to_all_bytes(model, Layout(dp=4, ep=4, micro_batch_size=2), 3, p) == \
        3 * 3 * 4 * 2 * tokens * 3 / 4 * h * p
    allgather = dataclasses.replace(model, moe_token_dispatcher_type="allgather")
    assert all_to_all_bytes(allgather, Layout(dp=4, ep=4, micro_batch_size=2), 1, p) == 3 * 4 * 3 * tokens * h * p
    assert all_to_all_bytes(model, Layout(dp=4), 1, p) == 0
    dense = dataclasses.replace(model, num_experts=None)
    mlp = 2 * h * model.ffn_size
    expert = 2 * h * model.expert_ffn_size
    per_token = 3 * (dense_macs_per_token_per_layer(dense) - mlp + h * 4 + 2 * expert)   # router + top-2
    assert model_flops_per_iteration(model, 8) - model_flops_per_iteration(dense, 8) == \
        6.0 * 8 * model.seq_length * (per_token - 3 * dense_macs_per_token_per_layer(dense))


MOE_ARGV = ["model=moe_tiny", "data=mock", "--train-iters", "1", "--global-batch-size", "8"]


def test_dry_run_shows_active_parameters_expert_memory_and_dispatch(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert pretrain_gpt.main(MOE_ARGV + ["--dry-run", "--expert-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    counts = count_parameters(load_model_config("moe_tiny"))
    assert f"{counts.total / 1e6:,.2f}M parameters ({counts.active / 1e6:,.2f}M active per token: 2 of 4 experts)" in out
    assert "experts: 2 of 4 per rank (EP=2)" in out and "reduced over DP x CP / EP = 2 ranks" in out
    assert "token dispatch (alltoall):" in out and "TFLOP per step of the active parameters" in out


@pytest.mark.parametrize("argv, world_size", [
    ([], 4),
    (["--context-parallel-size", "2", "--attention-dropout", "0"], 2),   # DP 1: EP is carved from DP x CP = 2
])
def test_out_of_memory_doctor_offers_more_expert_parallelism(argv, world_size):
    cfg = parse_args(MOE_ARGV + ["--micro-batch-size", "1"] + argv)
    layout = Layout.from_config(cfg, world_size)
    memory = stage_memory(cfg.model, layout, 0, 8, dtype_bytes=4, numerics=Numerics.cpu())
    error = torch.OutOfMemoryError(f"CUDA out of memory. GPU 0 has a total capacity of "
                                   f"{memory.states * 0.8 / 2**20:.2f} MiB of which 1.00 MiB is free.")
    message = diagnose_out_of_memory(cfg, error, world_size=world_size, cuda=False, suggest=False)
    assert "--expert-model-parallel-size 2" in message and "2 experts per rank" in message


def test_deepseek_v3_671b_fits_80_gb_on_1024_gpus(monkeypatch, capsys):
    """EP 256 leaves each GPU one routed expert per MoE layer (58 x 44M parameters, whose gradients and Adam states
    no expert-data-parallel rank shares: expert DP = DP / EP = 1), TP 4 with sequence parallelism splits attention,
    dense MLPs, shared experts and the vocabulary, ZeRO-2 shards their gradients and Adam states over DP 256, and
    full recompute keeps one layer input per layer: ~56 GiB of the 74.5 GiB (80 GB)."""
    monkeypatch.setenv("WORLD_SIZE", "1024")
    argv = ["model=deepseek_v3_671b", "data=mock", "--train-iters", "1", "--micro-batch-size", "1",
            "--global-batch-size", "1024", "--bf16", "--use-distributed-optimizer", "--zero-stage", "2",
            "--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-model-parallel-size", "256",
            "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1", "--dry-run"]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "TP=4 x PP=1 x DP=256 (EP=256)" in out and "671,026.40M parameters (37,552.28M active" in out
    total = float(next(line for line in out.splitlines() if line.strip().startswith("0 ")).split()[-1].replace(",", ""))
    assert 40 < total < 80e9 / 2**30, out
