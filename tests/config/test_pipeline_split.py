"""Megatron's uneven-pipeline options (megalite.config.pipeline_split): each virtual stage's layers and first layer
equal Megatron-core's own functions for the same options, and a split that does not add up is refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megalite.config import ConfigError, validate
from megalite.config.pipeline_split import accounted_split, first_last_split, layout_split, layout_text
from megalite.pipeline.partition import chunks_of_rank

from ..helpers import tiny_config

# (num_layers, PP, V, options): what Megatron's arguments would carry.
CASES = [
    (6, 4, 1, {"first": 1, "last": 1}),
    (61, 8, 1, {"first": 5, "last": 8}),
    (16, 4, 2, {"first": 2, "last": 6}),
    (10, 3, 2, {"first": 2}),
    (7, 4, 1, {"embedding": True}),
    (6, 2, 2, {"embedding": True, "loss": True}),
    (6, 2, 2, {"layout": "E|ttt|tt|tL"}),
    (61, 16, 2, {"layout": "Et*3|(tt|)*29,|L"}),
]


def _megalite_split(num_layers, pp, v, options):
    if "layout" in options:
        return layout_split(options["layout"], pp, num_layers)
    if "first" in options or "last" in options:
        return first_last_split(num_layers, pp, v, options.get("first"), options.get("last"))
    return accounted_split(num_layers, pp * v, options.get("embedding", False), options.get("loss", False))


@pytest.mark.parametrize("num_layers, pp, v, options", CASES)
def test_splits_equal_megatron_cores(num_layers, pp, v, options):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = PipelineParallelLayerLayout(options["layout"], pp) if "layout" in options else None
    config = SimpleNamespace(
        num_layers=num_layers, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=v if v > 1 else None,
        num_layers_in_first_pipeline_stage=options.get("first"), num_layers_in_last_pipeline_stage=options.get("last"),
        account_for_embedding_in_pipeline_split=options.get("embedding", False),
        account_for_loss_in_pipeline_split=options.get("loss", False), mtp_num_layers=None,
        pipeline_model_parallel_layout=None)
    split = _megalite_split(num_layers, pp, v, options)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    try:
        for rank in range(pp):
            for chunk in chunks_of_rank(split, pp, v, rank):
                vp_stage = chunk.virtual_stage // pp
                where = dict(vp_stage=vp_stage, pp_rank=rank)
                if layout:   # (Megatron's layout-reading functions ask its process groups for the rank; asked here)
                    expected = layout.get_num_layers_to_build(**where), layout.get_layer_offset(**where)
                else:
                    expected = (get_num_layers_to_build(config, **where), get_transformer_layer_offset(config, **where))
                assert (chunk.num_layers, chunk.first_layer) == expected
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    assert sum(split) == num_layers and layout_split(layout_text(split), pp, num_layers) == split


@pytest.mark.parametrize("parallel, message", [
    ({"decoder_first_pipeline_num_layers": 7}, "--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-"
     "layers: the first and last stages take 7 layers, the model has 6"),
    ({"decoder_first_pipeline_num_layers": 1, "num_virtual_stages_per_pipeline_rank": 2},
     "the first stage's 1 layers do not split over its 2 virtual stages"),
    ({"pipeline_model_parallel_layout": "Et|tt|tL"}, "has 3 stages, not a multiple of the pipeline-parallel size 2"),
    ({"pipeline_model_parallel_layout": "Et|tx|t|tL"}, "unknown symbol(s) x"),
    ({"pipeline_model_parallel_layout": "Et|tt|L"}, "has 3 stages"),
    ({"pipeline_model_parallel_layout": "Ett|tt|tL|"}, "must end with the loss L"),
    ({"pipeline_model_parallel_layout": "Et|tt|tt|tmL"}, "places 1 multi-token-prediction layers (m), the model has 0"),
    ({"pipeline_model_parallel_layout": "Ettt|tttL", "num_virtual_stages_per_pipeline_rank": 2},
     "--pipeline-model-parallel-layout has 1 virtual stage(s) per rank, --num-virtual-stages-per-pipeline-rank says 2"),
    ({"pipeline_model_parallel_layout": "Ett|ttL", "decoder_last_pipeline_num_layers": 1},
     "--pipeline-model-parallel-layout and --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
     "both split the pipeline: give one"),
    ({"decoder_last_pipeline_num_layers": 1, "pipeline_schedule": "zbv"}, "zbv puts the first and last virtual "
     "stages on rank 0"),
    ({"account_for_loss_in_pipeline_split": True}, "6 layers + the loss = 7 do not split evenly over 2 virtual stages"),
])
def test_bad_splits_are_refused_by_name(parallel, message):
    cfg = tiny_config(pp=2, model={"num_layers": 6}, parallel=parallel)
    with pytest.raises(ConfigError) as error:
        validate(cfg, 2)
    assert message in str(error.value)


def test_an_uneven_split_validates_where_an_even_one_cannot():
    with pytest.raises(ValueError, match="leave 5 layers to 1 middle rank.s. x 2 virtual stages, not evenly"):
        first_last_split(7, 2, 2, 2, None)
    with pytest.raises(ConfigError, match="not divisible"):
        validate(tiny_config(pp=4, model={"num_layers": 6}), 4)
    validate(tiny_config(pp=4, model={"num_layers": 6}, parallel={"decoder_first_pipeline_num_layers": 1,
                                                                   "decoder_last_pipeline_num_layers": 1}), 4)
