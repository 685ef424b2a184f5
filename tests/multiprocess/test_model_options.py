"""Architecture and activation-memory options against the single-process run, and recompute against no recompute.

Options are combined into a few configurations so that each is exercised in a parallel layout and compared with its
single process (10 iterations, fp32, dropout off: losses and gradient norms within 1e-5 relative, final weights
within 1e-5):

- Llama-like (rotary positions, RMSNorm, SwiGLU, grouped-query attention with 2 key/value heads, no biases, untied
  output layer) at TP=2 x PP=2: one key/value head per TP rank; with yarn rope scaling and two multi-token prediction
  modules (DeepSeek-V3's), whose last stage holds a copy of the word embedding tied to the first stage's;
  and (another case) gpt-oss' MLP (clamped quick GeGLU with offset 1) in place of SwiGLU, and YaRN with gpt-oss'
  unrounded correction range;
- the same with a sliding window (each query and the 7 tokens before it, of 32) in layers 1, 3 and 4 (layer 2
  global: a 0/1 skip pattern), gpt-oss' learnable attention sinks, sequence parallelism and selective recompute at
  TP=2 x PP=2: pipeline stages send sequence shards, the recomputed core rebuilds the windowed mask, and each rank
  trains the sink logits of its heads; made a Gemma 3 as well: GeGLU, sandwich and per-head q/k norms, all
  zero-centred, embeddings scaled on the first stage, the output layer tied to them on the last, a softmax scale,
  and the windowed layers' own rotary base beside the global layers' linearly scaled one;
- DeepSeek's multi-latent attention (a query latent, yarn with mscale^2 in the softmax) with sequence parallelism
  and selective recompute at TP=2 x PP=2: the replicated down-projections' sequence-shard gradients summed over TP,
  the up-projections split by heads;
- GPT-2-style with the tanh GeLU, sequence parallelism and full recompute (block) at TP=2 x DP=2 with ZeRO-2,
  overlapped, small buckets: the sequence-parallel gradients (norms, biases, position table) are summed over TP on DP
  shards;
- the Llama-like model with Qwen2's q/k/v biases and Llama 3's rope scaling at TP=4, where each of its 2 key/value
  heads (and their biases) is split over 2 TP ranks which all-gather it over a subgroup of the two (multi-query
  attention, 1 head over 4 ranks, takes the same path over the whole TP group), with sandwich norms, sequence
  parallelism and full recompute (uniform); its communication, counted, is the planner's.

With dropout on, full and selective recompute at TP=2 x PP=2 (1F1B, so other micro-batches' forwards run between a
forward and its recompute) give exactly the losses, gradient norms and weights of the run without recompute; so does
offloading what attn_norm, core_attn, attn_proj and mlp_norm save (several micro-batches' copies in flight).
"""

from __future__ import annotations

import pytest

from megalite.training import Trainer

from ..helpers import max_relative_difference, tiny_config
from .equivalence import CPU, check_against_reference, train
from .groups import layout

LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "ffn_hidden_size": 176,
         "group_query_attention": True, "num_query_groups": 2, "disable_bias_linear": True,
         "untie_embeddings_and_output_weights": True}
SP = {"sequence_parallel": True}
FULL_BLOCK = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
FULL_UNIFORM = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}
SELECTIVE = {"recompute_granularity": "selective"}
DENSE_MODULES = {**SELECTIVE, "recompute_modules": "core_attn mlp layernorm"}   # Megatron's --recompute-modules
OFFLOAD = {"fine_grained_activation_offloading": True, "offload_modules": "attn_norm core_attn attn_proj mlp_norm"}
WINDOW = {"window_size": "7,0", "window_attn_skip_freq": "[1,0,1,1]"}
GEMMA = {"swiglu": False, "gated_linear_unit": True, "openai_gelu": True, "sandwich_norm": True, "qk_layernorm": True,
         "apply_layernorm_1p": True, "scale_embeddings": True, "softmax_scale": 0.3, "local_rotary_base": 1000,
         "use_rope_scaling": True, "rope_scaling_type": "linear", "rope_scaling_factor": 2.0,
         "untie_embeddings_and_output_weights": False}
ZERO2 = {"use_distributed_optimizer": True, "zero_stage": 2, "overlap_grad_reduce": True, "ddp_bucket_size": 4000}
YARN = {"use_rope_scaling": True, "rope_scaling_type": "yarn", "rope_scaling_factor": 4.0,
        "rope_scaling_original_max_position_embeddings": 8, "beta_fast": 4.0, "beta_slow": 0.5}
MLA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "ffn_hidden_size": 176,
       "disable_bias_linear": True, "multi_latent_attention": True, "q_lora_rank": 24, "kv_lora_rank": 16,
       "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 12}
GPT_OSS_MLP = {"swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 0.1}
QWEN2_ROPE_SCALING = {"add_qkv_bias": True, "use_rope_scaling": True, "rope_scaling_factor": 4.0,
                      "rope_scaling_original_max_position_embeddings": 16}


@pytest.mark.parametrize("label, tp, pp, model, parallel, optimizer", [
    ("llama-like + yarn rope scaling + 2-depth MTP TP=2 x PP=2", 2, 2, {**LLAMA, **YARN, "mtp_num_layers": 2}, {},
     {}),
    ("gemma-like + sliding window + learnable sinks + sequence parallel + recompute of core_attn, mlp and layernorm "
     "TP=2 x PP=2", 2, 2, {**LLAMA, **DENSE_MODULES, **WINDOW, **GEMMA, "softmax_type": "learnable"}, SP, {}),
    ("multi-latent attention + yarn with mscale + sequence parallel + recompute of core_attn, mla_up_proj and "
     "layernorm TP=2 x PP=2", 2, 2,
     {**MLA, **YARN, "mscale_all_dim": 0.8, **SELECTIVE, "recompute_modules": "core_attn mla_up_proj layernorm"},
     SP, {}),
    ("llama-like + gpt-oss' clamped quick GeGLU + unrounded yarn rope scaling TP=2 x PP=2", 2, 2,
     {**LLAMA, **YARN, **GPT_OSS_MLP, "yarn_unrounded_correction_range": True}, {}, {}),
    ("GPT + tanh GeLU + sequence parallel + full block recompute TP=2 x DP=2 ZeRO-2", 2, 1,
     {**FULL_BLOCK, "openai_gelu": True}, SP, ZERO2),
    ("llama-like + q/k/v biases + rope scaling (key/value heads split over 2 ranks) + sandwich norms + sequence "
     "parallel + full uniform recompute TP=4", 4, 1, {**LLAMA, **QWEN2_ROPE_SCALING, **FULL_UNIFORM,
                                                      "sandwich_norm": True}, SP, {}),
])
def test_matches_single_process(label, tp, pp, model, parallel, optimizer):
    # 4 layers where the pipeline needs them (2 per stage), else 2; micro-batches of 2 samples: 4 micro-batches.
    cfg = tiny_config(tp=tp, pp=pp, model={"num_layers": 2 * pp, **model}, parallel=parallel, optimizer=optimizer)
    check_against_reference(cfg, label=label)


def test_recompute_with_dropout_matches_no_recompute():
    def run(recompute):
        cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4, "hidden_dropout": 0.1, "attention_dropout": 0.1,
                                             **recompute},
                          training={"micro_batch_size": 1, "train_iters": 4})
        records, weights = train(cfg)
        return [r for r in records if "loss" in r], weights

    plain_records, plain_weights = run({})
    for label, recompute in [("full", {**FULL_UNIFORM, "recompute_num_layers": 1}), ("selective", SELECTIVE),
                             ("core_attn, mlp and layernorm", DENSE_MODULES), ("offloading and no", OFFLOAD)]:
        records, weights = run(recompute)
        loss_diff = max_relative_difference([r["loss"] for r in records], [r["loss"] for r in plain_records])
        norm_diff = max_relative_difference([r["grad_norm"] for r in records],
                                            [r["grad_norm"] for r in plain_records])
        weight_diff = max(float((weights[n] - plain_weights[n]).abs().max()) for n in weights)
        print(f"dropout 0.1, {label} recompute vs none at TP=2 x PP=2: loss diff {loss_diff:.1e}, grad norm diff "
              f"{norm_diff:.1e}, weight diff {weight_diff:.1e}")
        assert loss_diff == 0 and norm_diff == 0 and weight_diff == 0


def test_a_shared_key_value_head_is_gathered_over_its_sharing_ranks_only():
    """TP=4 with 2 key/value heads: each head's [k; v] is all-gathered over the 2 ranks sharing it (a TP subgroup)
    and its gradient reduce-scattered there, as many elements per layer and micro-batch as the planner counts;
    nothing of it crosses the whole TP group."""
    from bench.comm_counter import count_communication   # noqa: PLC0415 - the benchmarks' counter, run as a test

    from megalite.planner import Layout   # noqa: PLC0415
    from megalite.planner.performance import kv_head_gather_elements   # noqa: PLC0415

    cfg = tiny_config(tp=4, model=LLAMA, training={"train_iters": 1}, data={"eval_interval": 0})
    with layout(4, 1):
        trainer = Trainer.on_registered_layout(cfg, CPU)
        with count_communication() as counter:
            trainer.train_step()
    per_pass = kv_head_gather_elements(cfg.model, Layout(tp=4, micro_batch_size=cfg.training.micro_batch_size))
    expected = per_pass * cfg.model.num_layers * trainer.num_micro_batches
    gathered, scattered = (counter.elements(op, "tensor_share") for op in ("all_gather", "reduce_scatter"))
    print(f"shared key/value heads at TP=4, G=2: {gathered:,} elements gathered and {scattered:,} reduce-scattered "
          f"per step over their 2 ranks, the planner's {expected:,}")
    assert gathered == scattered == expected > 0
    assert counter.elements("all_gather", "tensor") == 0
