"""Mixture-of-experts options: Megatron's flags and Hydra keys land on the schema, and every bad combination (EP not
dividing the experts or DP x CP, top-k over E, capacity with a dispatcher that cannot honour it, ...) is one line."""

from __future__ import annotations

import pytest

from megalite.config import ConfigError, validate
from megalite.config.cli import parse_command_line

from ..helpers import TINY_MOE, tiny_config


def _moe(model=None, **sections):
    return tiny_config(model={**TINY_MOE, **(model or {})}, **sections)


def test_megatron_flags_and_hydra_keys_set_the_moe_options():
    cfg = parse_command_line(["--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]",
                              "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather",
                              "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
                              "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                              "model.moe_aux_loss_coeff=0.01", "--qk-layernorm", "--num-layers", "2"], 2).config
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_layers(), m.moe_token_dispatcher_type) == (8, 2, [False, True],
                                                                                               "allgather")
    assert m.moe_router_enable_expert_bias and m.moe_aux_loss_coeff == 0.01 and m.qk_layernorm
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (4, 2)
    assert cfg.parallel.expert_model_parallel_size == 2
    validate(cfg, 2)


def test_valid_expert_layouts():
    validate(_moe(parallel={"expert_model_parallel_size": 4}), 4)
    validate(_moe(model={"num_experts": 8, "moe_router_topk": 4, "moe_router_num_groups": 4,
                         "moe_router_group_topk": 2}), 1)
    validate(_moe(tp=2, parallel={"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}), 4)
    validate(_moe(model={"moe_expert_capacity_factor": 1.5}), 1)


@pytest.mark.parametrize("cfg, world, message", [
    (tiny_config(parallel={"expert_model_parallel_size": 2}), 2, "--expert-model-parallel-size needs --num-experts"),
    (tiny_config(model={"moe_router_topk": 1}), 1, "--moe-router-topk needs --num-experts"),
    (_moe(parallel={"expert_model_parallel_size": 3}), 3, "--num-experts 4 is not divisible by "
                                                          "--expert-model-parallel-size 3"),
    (_moe(parallel={"expert_model_parallel_size": 4}, training={"global_batch_size": 8}), 2,
     "--expert-model-parallel-size 4 does not divide the data-parallel x context-parallel size 2"),
    (_moe(tp=2, parallel={"expert_model_parallel_size": 2}), 2,
     "--expert-model-parallel-size 2 does not divide the data-parallel x context-parallel size 1"),
    (_moe(model={"moe_router_topk": 5}), 1, "--moe-router-topk 5 is more than --num-experts 4"),
    (_moe(model={"moe_expert_capacity_factor": 1.0, "moe_token_dispatcher_type": "allgather"}), 1,
     "--moe-expert-capacity-factor (token dropping) needs --moe-token-dispatcher-type alltoall"),
    (_moe(model={"moe_router_enable_expert_bias": True}), 1,
     "--moe-router-enable-expert-bias biases sigmoid scores: it needs --moe-router-score-function sigmoid"),
    (_moe(tp=2, parallel={"expert_tensor_parallel_size": 3}), 2,
     "--expert-tensor-parallel-size 3 must be --tensor-model-parallel-size 2 or 1"),
    (_moe(model={"moe_token_dispatcher_type": "deepep"}), 1,
     "--moe-token-dispatcher-type must be alltoall or allgather, got 'deepep'"),
    (_moe(model={"moe_layer_freq": "[1,1,1]"}), 1, "--moe-layer-freq '[1,1,1]' has 3 entries for --num-layers 2"),
    (_moe(model={"moe_router_num_groups": 2}), 1,
     "--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing)"),
    (_moe(model={"moe_router_num_groups": 3, "moe_router_group_topk": 1}), 1,
     "--num-experts 4 is not divisible by --moe-router-num-groups 3"),
    (_moe(model={"moe_router_num_groups": 2, "moe_router_group_topk": 3}), 1,
     "--moe-router-group-topk 3 is more than --moe-router-num-groups 2"),
    (_moe(model={"num_experts": 8, "moe_router_topk": 3, "moe_router_num_groups": 4, "moe_router_group_topk": 1}), 1,
     "--moe-router-topk 3 is more than the 2 experts of --moe-router-group-topk 1 groups of 2"),
    (_moe(model={"moe_router_topk": 1, "moe_router_num_groups": 2, "moe_router_group_topk": 2}), 1,
     "--moe-router-topk 1 is less than --moe-router-group-topk 2 (a group is scored by the sum of its top k / "
     "group-topk experts)"),
    (_moe(model={"moe_router_num_groups": 0, "moe_router_group_topk": 1}), 1, "--moe-router-num-groups must be >= 1"),
    (tiny_config(model={"moe_router_group_topk": 1}), 1, "--moe-router-group-topk needs --num-experts"),
    (_moe(model={"moe_shared_expert_gate": True}), 1,
     "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
    (_moe(parallel={"expert_model_parallel_size": 2}, optimizer={"zero_stage": 3}), 2,
     "--zero-stage 3 shards expert parameters over the ranks holding the same experts, and "
     "--expert-model-parallel-size 2 leaves none"),
])
def test_bad_expert_options_are_one_line(cfg, world, message):
    with pytest.raises(ConfigError) as error:
        validate(cfg, world)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_pretrain_gpt_stops_a_bad_expert_layout_with_one_line(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(["model=moe_tiny", "data=mock", "--moe-router-topk", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "megalite: error: --moe-router-topk 5 is more than --num-experts 4"
