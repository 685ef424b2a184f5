"""The zero-bubble schedules (``--pipeline-schedule zero-bubble|zbv``) train exactly like the single process.

Each layout runs 10 iterations (fp32, dropout off, micro-batch 1 so several micro-batches accumulate) and is
compared with the single-process run by ``check_against_reference``: losses, evaluation losses and gradient norms
within 1e-5 relative, final weights within 1e-5. The layouts are those 1F1B is tested at (PP=2, PP=4, PP=2 x V=2,
TP=2 x PP=2 x DP=2), with the distributed optimizer and the overlapped gradient reduction over small buckets, so a
bucket's reduction starts after its last deferred W step; ZeRO-2 (reduce-scatter as buckets fill, every
micro-batch) and sequence parallelism (the weight gradient of a sequence-gathered linear, gathered again in its W
step) are covered once each. zbv places the chunks in a V: rank 0 holds the embedding and the loss, and the tied
embedding's two copies sit on one rank.
"""

from __future__ import annotations

import pytest

from ..helpers import tiny_config
from .equivalence import check_against_reference
from .groups import requires_world

OVERLAPPED = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 4000}


def _config(tp, pp, schedule, v=None, layers=4, optimizer=OVERLAPPED, parallel=None):
    return tiny_config(tp=tp, pp=pp, model={"num_layers": layers}, optimizer=optimizer,
                       parallel={"pipeline_schedule": schedule, "num_virtual_stages_per_pipeline_rank": v,
                                 **(parallel or {})},
                       training={"micro_batch_size": 1})


@requires_world(4)
@pytest.mark.parametrize("label, cfg, ranks", [
    ("zero-bubble PP=2 x DP=2", _config(1, 2, "zero-bubble"), None),
    ("zero-bubble PP=2 x DP=2 ZeRO-2", _config(1, 2, "zero-bubble", optimizer={**OVERLAPPED, "zero_stage": 2}),
     None),
    ("zero-bubble PP=4", _config(1, 4, "zero-bubble"), None),
    ("zero-bubble PP=2 x V=2", _config(1, 2, "zero-bubble", v=2), [0, 1]),
    ("zbv PP=2 x DP=2", _config(1, 2, "zbv"), None),
    ("zbv PP=4", _config(1, 4, "zbv", layers=8), None),
])
def test_zero_bubble_schedules_match_single_process(label, cfg, ranks):
    check_against_reference(cfg, ranks, label)


@requires_world(8)
@pytest.mark.parametrize("label, cfg", [
    ("zero-bubble TP=2 x PP=2 x DP=2", _config(2, 2, "zero-bubble")),
    ("zbv TP=2 x PP=2 x DP=2, sequence parallel", _config(2, 2, "zbv", parallel={"sequence_parallel": True})),
])
def test_zero_bubble_schedules_in_three_dimensions(label, cfg):
    check_against_reference(cfg, label=label)
