"""The rank order of process groups (pure function; the groups themselves are built in the distributed tests)."""

from __future__ import annotations

from megalite import parallel_state
from megalite.parallel_state import layout_groups, tensor_share_groups


def test_tp2_pp2_dp2_matches_the_documented_order():
    groups = layout_groups(8, tp=2, pp=2)
    assert groups["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(groups["data"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(groups["pipeline"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sorted(groups["model"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert sorted(groups["embedding"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    for world, tp, pp in [(8, 2, 2), (8, 1, 4), (12, 2, 3), (4, 4, 1), (1, 1, 1)]:
        for kind, groups in layout_groups(world, tp, pp).items():
            if kind == "embedding":   # middle pipeline stages hold no embedding
                continue
            members = sorted(r for g in groups for r in g)
            assert members == list(range(world)), (kind, world, tp, pp)


def test_single_stage_embedding_group_is_one_rank():
    assert layout_groups(4, tp=2, pp=1)["embedding"] == [[0], [1], [2], [3]]


def test_embedding_groups_join_first_and_last_stage_only():
    assert sorted(layout_groups(6, tp=1, pp=3)["embedding"]) == [[0, 4], [1, 5]]


def test_context_parallel_ranks_sit_between_tensor_and_data():
    # TP=2 x CP=2 x DP=2 (8 ranks): rank = dp * 4 + cp * 2 + tp.
    groups = layout_groups(8, tp=2, pp=1, cp=2)
    assert groups["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["context"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["data_context"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["model"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_hsdp_instances_are_adjacent_ranks_of_each_data_context_group():
    # TP=2 x DP=4 as 2 instances (8 ranks): each instance's ranks are adjacent in DP (one node), the replicas of a
    # shard sit one instance apart.
    groups = layout_groups(8, tp=2, pp=1, instances=2)
    assert groups["data_context"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["intra_instance"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["inter_instance"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    single = layout_groups(4, tp=1, pp=1)   # one instance: the DP x CP group, every rank its own replica
    assert single["intra_instance"] == single["data_context"] and single["inter_instance"] == [[0], [1], [2], [3]]


def test_context_parallel_with_pipeline_keeps_stages_outermost():
    # CP=2 x DP=2 x PP=2: rank = pp * 4 + dp * 2 + cp.
    groups = layout_groups(8, tp=1, pp=2, cp=2)
    assert groups["context"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["data_context"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["embedding"] == groups["pipeline"]


def test_every_rank_is_in_one_group_of_each_kind_with_context_parallelism():
    for world, tp, pp, cp in [(8, 2, 1, 2), (8, 1, 2, 2), (16, 2, 2, 2), (4, 1, 1, 4), (12, 1, 3, 2)]:
        groups = layout_groups(world, tp, pp, cp)
        for kind, members_list in groups.items():
            members = sorted(r for g in members_list for r in g)
            if kind != "embedding":
                assert members == list(range(world)), (kind, world, tp, pp, cp)
        dp = world // (tp * pp * cp)
        assert all(len(g) == cp * dp for g in groups["data_context"])
        # A data-with-context group is the union of the context groups of its data-parallel ranks.
        for g in groups["data_context"]:
            assert sorted(r for c in groups["context"] if c[0] in g for r in c) == g


def test_simulated_layout_places_a_context_parallel_rank():
    from megalite import parallel_state

    with parallel_state.simulated_layout(2, 1, 2, cp=2, tp_rank=1, cp_rank=1, dp_rank=0):
        assert parallel_state.get_context_parallel_world_size() == 2
        assert parallel_state.get_context_parallel_rank() == 1
        assert parallel_state.get_data_parallel_world_size() == 2
        assert parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 4
        assert parallel_state.get_tensor_model_parallel_rank() == 1
    assert not parallel_state.is_initialized()


def test_expert_parallel_ranks_are_carved_from_data_and_context_parallel_ranks():
    # DP=4, EP=2: expert groups of neighbouring DP ranks, expert-data groups across them.
    groups = layout_groups(4, tp=1, pp=1, ep=2)
    assert groups["expert"] == [[0, 1], [2, 3]]
    assert groups["expert_data"] == [[0, 2], [1, 3]]
    # TP=2 x DP=2, EP=2: an expert group joins ranks of equal TP rank; experts split over TP by default.
    groups = layout_groups(4, tp=2, pp=1, ep=2)
    assert groups["expert"] == [[0, 2], [1, 3]] and groups["expert_data"] == [[0], [1], [2], [3]]
    assert groups["expert_tensor"] == groups["tensor"]
    assert layout_groups(4, tp=2, pp=1, ep=2, etp=1)["expert_tensor"] == [[0], [1], [2], [3]]
    # TP=2 x CP=2 x DP=2 x PP=2, EP=2: EP takes the CP ranks first (CP is the inner of the two).
    groups = layout_groups(16, tp=2, pp=2, cp=2, ep=2)
    assert groups["expert"][:2] == groups["context"][:2] == [[0, 2], [1, 3]]
    assert groups["expert_data"][:2] == [[0, 4], [1, 5]]


def test_expert_groups_tile_every_data_context_group():
    for world, tp, pp, cp, ep in [(8, 1, 1, 1, 8), (8, 2, 2, 1, 2), (16, 2, 1, 2, 4), (12, 1, 3, 2, 2)]:
        groups = layout_groups(world, tp, pp, cp, ep)
        for g in groups["data_context"]:
            experts = [e for e in groups["expert"] if e[0] in g]
            replicas = [d for d in groups["expert_data"] if d[0] in g]
            assert sorted(r for e in experts for r in e) == g
            assert all(len(e) == ep for e in experts) and all(len(d) == len(g) // ep for d in replicas)
            assert all(len(set(e) & set(d)) == 1 for e in experts for d in replicas)


def test_bad_expert_layouts_are_refused():
    import pytest

    # Ranks that are not whole TP x CP x PP replicas: ParallelDims' one line, as validation says it.
    with pytest.raises(ValueError, match="^world size 6 is not divisible by --tensor-model-parallel-size 2 x "
                                         "--context-parallel-size 2 x --pipeline-model-parallel-size 1 = 4$"):
        layout_groups(6, tp=2, pp=1, cp=2)
    with pytest.raises(ValueError, match="EP 3 does not divide DP x CP = 4"):
        layout_groups(4, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match="must be TP"):
        layout_groups(4, tp=2, pp=1, etp=4)
def test_key_value_head_sharers_are_consecutive_ranks_of_a_tensor_group():
    # TP=8 x DP=2: groups of 2 and 4 consecutive TP ranks, every rank in one of each size; none for TP <= 2.
    shares = tensor_share_groups(16, tp=8, pp=1)
    assert sorted(shares) == [2, 4]
    assert shares[4] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert shares[2][:4] == [[0, 1], [2, 3], [4, 5], [6, 7]] and len(shares[2]) == 8
    # TP=4 x CP=2: TP ranks are innermost, so consecutive ranks still.
    assert tensor_share_groups(8, tp=4, pp=1, cp=2) == {2: [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert tensor_share_groups(8, tp=2, pp=2) == {}
    with parallel_state.simulated_layout(tp=4, tp_rank=3):
        assert parallel_state.get_tensor_model_parallel_subgroup(2).ranks == (2, 3)
        assert parallel_state.get_tensor_model_parallel_subgroup(4).ranks == (0, 1, 2, 3)
