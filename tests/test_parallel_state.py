"""The rank order of process groups (pure function; the groups themselves are built in the distributed tests)."""

from __future__ import annotations

from megalite.parallel_state import layout_groups


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
