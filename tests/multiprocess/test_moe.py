"""Mixture of experts with expert parallelism trains exactly like the single process.

Dropless routing (and, separately, a capacity factor), fp32, 10 iterations: per-iteration losses, gradient norms and
MoE metrics (balancing losses, expert loads, dropped tokens) within 1e-5 relative and final weights (every expert,
gathered by name, and the routers' expert biases) within 1e-5, at EP=2, EP=4, EP=2 x TP=2 (with sequence
parallelism; and with whole experts on each TP rank), EP=2 x DP=4 with ZeRO-3, EP=2 carved from CP=2 x DP=2, and
EP=2 x PP=2 x DP=4 (8 ranks; 1F1B, zero-bubble and ZB-V), with both dispatchers and with the distributed optimizer;
DeepSeek-V3's group-limited routing at EP=2 and EP=2 x TP=2; gpt-oss' experts (clamped quick GeGLU with offset and
biases, a router with a bias) and sinks at EP=2 (allgather, looped experts) and EP=2 x TP=2 (sequence parallelism,
grouped products, experts and their biases split over TP).
"""

from __future__ import annotations

import dataclasses

import pytest

from megalite.planner import count_parameters
from megalite.training import Trainer

from ..helpers import TINY_MOE, losses, max_relative_difference, tiny_config, with_checkpoint
from .equivalence import CPU, check_against_reference, resumed_losses
from .groups import layout, requires_world

# DeepSeek-V3's router (sigmoid scores, auxiliary-loss-free expert bias, per-sequence balancing loss) with a gated
# shared expert, Llama-style layers and grouped expert products.
DEEPSEEK_LIKE = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                 "moe_router_bias_update_rate": 1e-2, "moe_router_load_balancing_type": "seq_aux_loss",
                 "moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True, "swiglu": True,
                 "normalization": "RMSNorm", "position_embedding_type": "rope", "disable_bias_linear": True,
                 "moe_grouped_gemm": True}

# DeepSeek-V3's routing in small: a dense first layer, 8 experts in 4 groups, each token's top 4 from its best 2
# groups, the weights scaled by the routed scaling factor.
# --recompute-modules for every part of an MoE model but the whole MoE layer (the pipeline tests rerun that).
MOE_MODULES = {"recompute_granularity": "selective", "recompute_modules": "core_attn layernorm mlp moe_act shared_experts"}
DEEPSEEK_V3 = {**DEEPSEEK_LIKE, "num_experts": 8, "moe_router_topk": 4, "moe_router_num_groups": 4,
               "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5, "moe_layer_freq": "[0,1]"}


# gpt-oss in small: biases everywhere (the router's too), learnable sinks, experts of clamped quick GeGLU with offset 1
# (a clamp of 0.1, which the tiny model's activations exceed, where gpt-oss has 7).
GPT_OSS = {"quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 0.1,
           "softmax_type": "learnable", "normalization": "RMSNorm", "position_embedding_type": "rope"}


def moe_config(tp=1, pp=1, ep=1, model=None, parallel=None, **sections):
    return tiny_config(tp=tp, pp=pp, model={**TINY_MOE, **(model or {})},
                       parallel={"expert_model_parallel_size": ep, **(parallel or {})},
                       training={"micro_batch_size": 1}, **sections)


@requires_world(4)
@pytest.mark.parametrize("tp, ep, ranks, model, parallel, optimizer", [
    (1, 2, [0, 1], {}, {}, {}),
    (1, 2, [0, 1], {"moe_token_dispatcher_type": "allgather", **GPT_OSS}, {}, {}),
    (1, 4, None, DEEPSEEK_LIKE, {}, {"use_distributed_optimizer": True}),
    (1, 2, [0, 1], DEEPSEEK_V3, {}, {}),
    (2, 2, None, {**GPT_OSS, "moe_grouped_gemm": True}, {"sequence_parallel": True}, {}),
    (2, 2, None, {**DEEPSEEK_V3, **MOE_MODULES}, {"sequence_parallel": True}, {}),
    (2, 2, None, {"moe_token_dispatcher_type": "allgather"}, {"expert_tensor_parallel_size": 1}, {}),
    (1, 2, None, {}, {}, {"zero_stage": 3}),
    (1, 2, None, {}, {}, {"use_distributed_optimizer": True, "optimizer": "muon"}),   # Muon per expert, over EDP
    (1, 2, None, {}, {}, {"zero_stage": 3, "optimizer": "muon"}),   # the same over ZeRO-3's EDP mesh
    (1, 2, None, {"attention_dropout": 0.0}, {"context_parallel_size": 2}, {}),   # EP from DP x CP: EDP = 2
])
def test_expert_parallel_matches_single_process(tp, ep, ranks, model, parallel, optimizer):
    cfg = moe_config(tp=tp, ep=ep, model=model, parallel=parallel, optimizer=optimizer)
    check_against_reference(cfg, ranks, f"moe tp={tp} ep={ep} ranks={ranks} {model} {parallel} {optimizer}")


@requires_world(4)
def test_capacity_factor_drops_the_tokens_of_the_single_process():
    cfg = moe_config(ep=2, model={"moe_expert_capacity_factor": 1.0})
    records = check_against_reference(cfg, [0, 1], "moe ep=2 capacity 1.0")   # dropped counts compared too
    if records is not None:
        assert all(sum(r["moe_dropped"]) > 0 for r in records)


@requires_world(8)
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "zbv"])   # zero-bubble: the shared expert's W deferred
def test_expert_parallel_with_pipeline_matches_single_process(schedule):
    layers = {"num_layers": 4} if schedule == "zbv" else {}   # its v-shape: two chunks per rank
    recompute = {"recompute_granularity": "selective", "recompute_modules": "moe"}   # all-to-alls rerun in backward
    cfg = moe_config(pp=2, ep=2, model={**DEEPSEEK_LIKE, **layers, **recompute},
                     parallel={"pipeline_schedule": schedule},
                     optimizer={"use_distributed_optimizer": True, "overlap_grad_reduce": True})
    check_against_reference(cfg, label=f"moe ep=2 pp=2 dp=4 {schedule}")


@requires_world(4)
def test_checkpoint_saved_at_ep2_resumes_at_ep1_and_ep4(directory):
    """Experts are stored by global name with their optimizer states (sharded over the expert-data-parallel ranks
    at save) and the expert biases: saved at EP=2 x EDP=2 after 4 of 6 iterations, resumed at EP=1 and EP=4 (DP=4),
    iterations 5-6 equal the uninterrupted run's."""
    cfg = moe_config(ep=2, model={"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
                     optimizer={"use_distributed_optimizer": True, "adam_eps": 1e-5},
                     data={"eval_interval": 0})
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, train_iters=6))
    with layout(ep=2):
        trainer = Trainer.on_registered_layout(with_checkpoint(cfg, save=directory, save_interval=4), CPU)
        held = count_parameters(cfg.model).per_stage[0]   # every expert, whichever rank holds it (EP=1)
        assert f"{held / 1e6:.2f}M parameters (" in trainer.describe() and "active per token, EP=2" in \
            trainer.describe()
        uninterrupted = losses(trainer.train())
    for ep, distributed in [(1, False), (4, True)]:
        resumed_cfg = dataclasses.replace(
            with_checkpoint(cfg, load=f"{directory}/iter_0000004"),
            parallel=dataclasses.replace(cfg.parallel, expert_model_parallel_size=ep),
            optimizer=dataclasses.replace(cfg.optimizer, use_distributed_optimizer=distributed))
        resumed = resumed_losses(resumed_cfg, 1, 1, None, 4, ep=ep)
        difference = max_relative_difference(resumed, uninterrupted[4:])
        print(f"MoE saved at EP=2 x EDP=2 (ZeRO-1) after 4 iterations, resumed at EP={ep}: iterations 5-6 max rel "
              f"loss diff {difference:.1e}")
        assert len(resumed) == 2 and difference < 1e-5
