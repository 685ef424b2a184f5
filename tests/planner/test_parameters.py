"""Parameter counts: the planner's arithmetic against the real model, built on the ``meta`` device (no memory) under
a shape-only layout, for every config in configs/model at TP 1/2/4 and PP 1/2, pipeline stage by stage."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch

from megalite import parallel_state
from megalite.config import ConfigError, MegaliteConfig, ParallelConfig, validate
from megalite.model import GPTModel
from megalite.pipeline.partition import chunks_of_rank
from megalite.planner import Layout, count_parameters, load_model_config
from megalite.planner.parameters import layer_tensors, rank_tensors

CONFIGS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "configs" / "model").glob("*.yaml"))
# Configs checked rank by rank at fewer layers and experts (the same tensors per layer; building 36 x 128 experts six
# times costs ~50 s): their full counts are checked against transformers below.
def _real_stage(model, tp: int, pp: int, pp_rank: int, v: int = 1,
                split=None) -> list[tuple[str, torch.nn.Parameter]]:
    with parallel_state.simulated_layout(tp, pp, pp_rank=pp_rank), torch.device("meta"):
        chunks = [GPTModel(model, None, pre_process=c.is_first, post_process=c.is_last, layer_offset=c.first_layer,
                           num_layers=c.num_layers) for c in chunks_of_rank(split or model.num_layers, pp, v, pp_rank)]
    # Parameters only: the marked buffers canonical_named_parameters adds (routers' expert biases) are no optimizer's
    return [item for chunk in chunks for item in chunk.canonical_named_parameters()
            if isinstance(item[1], torch.nn.Parameter)]


# Configs whose layers repeat, shortened: building all 61 layers of 256 experts on the meta device takes ~40 s
# (gpt-oss-120b ~50 s, Qwen3-30B-A3B ~45 s).
SHORTENED = {"deepseek_v3_671b": {"num_layers": 5, "moe_layer_freq": "[0]*3+[1]*2"},
             "gpt_oss_120b": {"num_layers": 4, "num_experts": 8}, "qwen3_30b_a3b": {"num_layers": 4, "num_experts": 8}}


@pytest.mark.parametrize("name", CONFIGS)
def test_counts_equal_the_real_model_rank_by_rank(name):
    model = dataclasses.replace(load_model_config(name), **SHORTENED.get(name, {}))
    checked = 0
    for tp, pp in itertools.product((1, 2, 4), (1, 2)):
        try:
            validate(MegaliteConfig(model=model, parallel=ParallelConfig(tp, pp)), tp * pp)
        except ConfigError:   # e.g. gpt2_xl's 25 heads at TP 2
            continue
        count = count_parameters(model, tp, pp)
        canonical = {}
        for pp_rank in range(pp):
            real = _real_stage(model, tp, pp, pp_rank)
            planned = [t for chunk in rank_tensors(model, tp, pp, 1, pp_rank) for t in chunk]
            assert count.per_stage[pp_rank] == sum(p.numel() for _, p in real), (tp, pp, pp_rank)
            # The same tensors in the same order, which the gradient-bucket layout (padding) depends on, with the
            # same first dimension, which ZeRO-3 shards over DP.
            assert [(n, p.numel(), p.shape[0]) for n, p in real] == [(t.name, t.numel, t.dim0) for t in planned]
            canonical.update((n, math.prod(p.full_shape)) for n, p in real)
        assert count.total == sum(canonical.values()), (tp, pp)
        checked += 1
    assert checked >= 2


def test_interleaved_stages_count_their_chunks():
    model = load_model_config("llama_tiny", num_layers=8)
    for pp_rank in range(2):
        real = _real_stage(model, 2, 2, pp_rank, v=2)
        assert count_parameters(model, 2, 2, 2).per_stage[pp_rank] == sum(p.numel() for _, p in real)


def test_uneven_stages_count_their_layers():
    # 6 layers as E|ttt|tt|tL over PP=2 x V=2: rank 0 holds the embedding and 3 layers, rank 1 3 layers and the head.
    model = load_model_config("llama_tiny", num_layers=6)
    cfg = MegaliteConfig(model=model, parallel=ParallelConfig(1, 2, pipeline_model_parallel_layout="E|ttt|tt|tL"))
    validate(cfg, 2)
    layout = Layout.from_config(cfg, 2)
    assert layout.split == (0, 3, 2, 1) and layout.virtual_stages == 2 and "layers 0/3/2/1" in layout.describe()
    count = count_parameters(model, 1, 2, 2, split=layout.split)
    for pp_rank in range(2):
        real = _real_stage(model, 1, 2, pp_rank, v=2, split=layout.split)
        assert count.per_stage[pp_rank] == sum(p.numel() for _, p in real)
    assert count.per_stage[0] != count_parameters(model, 1, 2, 2, split=(1, 2, 2, 1)).per_stage[0]
    # The planner's layout runs as the same split (Megatron's layout string), whichever way the user gave it.
    first_last = dataclasses.replace(cfg, parallel=ParallelConfig(1, 2, decoder_first_pipeline_num_layers=2,
                                                                 num_virtual_stages_per_pipeline_rank=2))
    applied = Layout.from_config(first_last, 2).apply(cfg)
    assert applied.parallel.pipeline_model_parallel_layout == "Et|tt|t|ttL"
    assert applied.parallel.decoder_first_pipeline_num_layers is None


@pytest.mark.parametrize("name, options", [("llama_tiny", {}), ("llama_tiny", {"untie_embeddings_and_output_weights": False}),
                                           ("moe_tiny", {})])
def test_multi_token_prediction_is_counted_on_the_last_stage(name, options):
    """Two MTP modules (norms, projection, a layer like the last one: MoE in moe_tiny), and on a last stage without
    the embedding its tied copy."""
    model = load_model_config(name, mtp_num_layers=2, **options)
    for tp, pp in ((1, 1), (2, 2)):
        for pp_rank in range(pp):
            real = _real_stage(model, tp, pp, pp_rank)
            planned = [t for chunk in rank_tensors(model, tp, pp, 1, pp_rank) for t in chunk]
            assert [(n, p.numel(), p.shape[0]) for n, p in real] == [(t.name, t.numel, t.dim0) for t in planned]
    plain = count_parameters(dataclasses.replace(model, mtp_num_layers=None))
    h = model.hidden_size
    extra = 2 * (sum(t.full_numel for t in layer_tensors(model, 1, model.num_layers - 1)) + 2 * h * h + 3 * h)
    assert count_parameters(model).total == plain.total + extra


def test_qkv_biases_are_counted():
    """--add-qkv-bias (Qwen2) on a model without biases: the QKV projection's bias, split over TP, and no other."""
    model = load_model_config("llama_tiny", add_qkv_bias=True)
    real = _real_stage(model, 2, 1, 0)
    planned = [t for chunk in rank_tensors(model, 2, 1, 1, 0) for t in chunk]
    assert [(n, p.numel()) for n, p in real] == [(t.name, t.numel) for t in planned]
    assert sum(name.endswith("bias") for name, _ in real) == model.num_layers


def test_gpt_layers_are_12h2_plus_13h():
    model = load_model_config("gpt2_medium")
    h = model.hidden_size
    assert sum(t.full_numel for t in layer_tensors(model, 1, 0)) == 12 * h * h + 13 * h
    assert count_parameters(model).total == 354_823_168   # GPT-2 medium as Hugging Face counts it (unpadded)


# Qwen3-32B's config.json as published on the Hugging Face hub (the keys that shape the model).
QWEN3_32B = {"model_type": "qwen3", "num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936,
             "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False,
             "sliding_window": None, "max_window_layers": 64}


def test_qwen3_32b_counts_what_transformers_builds():
    """configs/model/qwen3_32b.yaml is what importing the published config makes (bar the sequence length), and the
    planner counts the parameters of transformers' Qwen3ForCausalLM built from that config (32.8B)."""
    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint.hf_llama import model_config_from

    model = load_model_config("qwen3_32b")
    assert dataclasses.replace(model_config_from(QWEN3_32B), seq_length=model.seq_length) == model
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_32B))
    hf_count = sum(p.numel() for p in hf.parameters())
    assert count_parameters(model).total == hf_count and hf_count // 10**8 == 327


DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                   qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                   max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                                    "original_max_position_embeddings": 4096, "beta_slow": 1.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0})


def test_deepseek_v3_counts_what_transformers_builds():
    """configs/model/deepseek_v3_671b.yaml is what importing the published config makes (bar the sequence length and
    how it trains), and the planner counts the parameters of transformers' DeepseekV3ForCausalLM built from it on the
    meta device: 671B, 37B active per token."""
    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint.hf_deepseek import model_config_from

    model = load_model_config("deepseek_v3_671b")
    imported = model_config_from({"model_type": "deepseek_v3", **DEEPSEEK_V3})
    training = dict(seq_length=model.seq_length, moe_layer_freq=model.moe_layer_freq, moe_grouped_gemm=True,
                    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4)
    assert dataclasses.replace(imported, **training) == model and imported.moe_layers() == model.moe_layers()
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_V3))
    hf_count = sum(p.numel() for p in hf.parameters())
    count = count_parameters(model)
    assert count.total == hf_count and (hf_count // 10**9, count.active // 10**9) == (671, 37)


def test_gpt_oss_120b_counts_what_transformers_builds():
    """configs/model/gpt_oss_120b.yaml is what importing transformers' GptOssConfig (gpt-oss-120b's) makes (bar the
    sequence length and the spelling of the window pattern), and the planner counts the parameters of its
    GptOssForCausalLM: 116.8B, 5.1B active per token as OpenAI counts them (without the embedding table, which does
    no product; the planner's active count keeps it, as for Mixtral's published 12.9B)."""
    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint.hf_gpt_oss import model_config_from

    model = load_model_config("gpt_oss_120b")
    imported = model_config_from(transformers.GptOssConfig().to_dict())
    assert imported.attention_windows() == model.attention_windows()
    assert dataclasses.replace(imported, seq_length=model.seq_length, window_attn_skip_freq="2",
                               moe_grouped_gemm=True) == model
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig())
    hf_count = sum(p.numel() for p in hf.parameters())
    count = count_parameters(model)
    assert count.total == hf_count and hf_count // 10**7 == 11682
    assert (count.active - count.embedding) // 10**7 == 513


# Gemma 3 27B's text_config as published on the Hugging Face hub (google/gemma-3-27b-pt; the keys left out take
# Gemma3TextConfig's defaults: vocabulary 262208, rope_theta 1e6, rope_local_base_freq 1e4, every sixth layer global).
GEMMA3_27B = {"model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376, "intermediate_size": 21504,
              "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168,
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}


def test_gemma3_27b_counts_what_transformers_builds():
    """configs/model/gemma3_27b.yaml is what importing the published config makes (bar the sequence length), and the
    planner counts, sandwich norms and q/k norms included, the parameters of transformers' Gemma3ForCausalLM built
    from that config (27.0B)."""
    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint.hf_gemma3 import model_config_from

    model = load_model_config("gemma3_27b")
    assert dataclasses.replace(model_config_from(GEMMA3_27B), seq_length=model.seq_length) == model
    with torch.device("meta"):
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3_27B))
    hf_count = sum(p.numel() for p in hf.parameters())
    assert count_parameters(model).total == hf_count and hf_count // 10**8 == 270


def test_simulated_layout_registers_one_rank_s_groups_and_restores_the_previous():
    assert not parallel_state.is_initialized()
    with parallel_state.simulated_layout(2, 4, 2, tp_rank=1, pp_rank=2, dp_rank=1):
        assert parallel_state.get_tensor_model_parallel_rank() == 1
        assert parallel_state.get_pipeline_model_parallel_world_size() == 4
        assert parallel_state.get_pipeline_model_parallel_rank() == 2
        assert parallel_state.get_data_parallel_rank() == 1
        assert parallel_state.get_embedding_group() is None            # a middle stage
        assert parallel_state.get_tensor_model_parallel_group().group is None
    assert not parallel_state.is_initialized()
    with parallel_state.simulated_layout(2, 2, pp_rank=1):
        assert parallel_state.get_embedding_group().size == 2         # the last stage shares the tied embedding
    with pytest.raises(ValueError):
        with parallel_state.simulated_layout(2, tp_rank=2):
            pass


def test_learnable_sinks_are_counted():
    """--softmax-type learnable (gpt-oss): one logit per head and layer, split over TP."""
    model = load_model_config("llama_tiny", softmax_type="learnable")
    real = _real_stage(model, 2, 1, 0)
    planned = [t for chunk in rank_tensors(model, 2, 1, 1, 0) for t in chunk]
    assert [(n, p.numel(), p.shape[0]) for n, p in real] == [(t.name, t.numel, t.dim0) for t in planned]
    assert sum(name.endswith("softmax_offset") for name, _ in real) == model.num_layers
