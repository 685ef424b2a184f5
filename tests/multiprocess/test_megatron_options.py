"""The options of Megatron's example scripts, each at TP=2 x PP=2 against the single process (fp32, dropout off,
10 iterations: losses, evaluation losses and gradient norms within 1e-5 relative, final weights within 1e-5; see
equivalence.py): head size (--kv-channels), partial rotary, zero-centred norms, no positions, --decoupled-lr (with the
tied embedding's copy on the last stage), a batch ramp-up with sample-based length and warm-up fraction (also at
TP=2 x PP=2 x DP=2, where the micro-batches of a step change with the batch); --grad-reduce-in-bf16 in bf16 within
1e-3 (bf16 arithmetic, not an exact comparison; measured 3e-5), its gradients kept in bf16 on every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite.training import Trainer

from ..helpers import losses, max_relative_difference, single_layout, tiny_config
from .equivalence import CPU, check_against_reference
from .groups import layout, requires_world

LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
         "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 176,
         "untie_embeddings_and_output_weights": True}
# 2, 2, 2, 2, 4, 4, 6, 6 while at most 24 samples are consumed, then 8s: 10 iterations for 44 samples.
RAMP = {"rampup_batch_size": "2 2 24", "global_batch_size": 8, "train_iters": None, "train_samples": 44}
SAMPLE_BASED = {"lr_warmup_iters": 0, "lr_warmup_fraction": 0.1}


@requires_world(4)
@pytest.mark.parametrize("label, model, optimizer, training", [
    ("Llama-style, --kv-channels 32, --rotary-percent 0.5, zero-centred RMSNorm, --decoupled-lr (untied)",
     {**LLAMA, "kv_channels": 32, "rotary_percent": 0.5, "apply_layernorm_1p": True},
     {"decoupled_lr": 3e-3, "decoupled_min_lr": 2e-4}, {}),
    ("GPT-style, --no-position-embedding, zero-centred LayerNorm, --kv-channels 8, --decoupled-lr (tied over PP)",
     {"no_position_embedding": True, "apply_layernorm_1p": True, "kv_channels": 8}, {"decoupled_lr": 3e-3}, {}),
    ("--rampup-batch-size 2 2 24 with --train-samples 44 and --lr-warmup-fraction 0.1", {}, SAMPLE_BASED, RAMP),
])
def test_megatron_options_match_single_process(label, model, optimizer, training):
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4, **model}, optimizer=optimizer,
                      training={"micro_batch_size": 1, **training})
    check_against_reference(cfg, label=f"tp=2 pp=2: {label}")


@requires_world(8)
def test_rampup_with_data_parallelism_matches_single_process():
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4}, optimizer={**SAMPLE_BASED, "decoupled_lr": 3e-3},
                      training={"micro_batch_size": 1, **RAMP})
    check_against_reference(cfg, label="tp=2 pp=2 dp=2: ramp-up 2 -> 8, sample-based, --decoupled-lr")


@requires_world(4)
def test_grad_reduce_in_bf16_stays_close_to_the_single_process():
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4}, training={"bf16": True, "micro_batch_size": 1},
                      optimizer={"grad_reduce_in_bf16": True}, data={"eval_interval": 0})
    with single_layout():
        reference = Trainer.on_registered_layout(dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)), CPU)
        assert reference.engine.grad_buffer.dtype == torch.bfloat16
        expected = losses(reference.train())
    with layout(2, 2):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        assert trainer.engine.grad_buffer.dtype == torch.bfloat16
        actual = losses(trainer.train())
    difference = max_relative_difference(actual, expected)
    print(f"tp=2 pp=2 --grad-reduce-in-bf16 (bf16): max rel loss diff {difference:.2e} over {len(actual)} iterations")
    assert difference < 1e-3 and actual[-1] < actual[0]
