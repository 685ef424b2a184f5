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
from megalite.planner import count_parameters, load_model_config
from megalite.planner.parameters import layer_tensors, rank_tensors

CONFIGS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "configs" / "model").glob("*.yaml"))


def _real_stage(model, tp: int, pp: int, pp_rank: int, v: int = 1) -> list[tuple[str, torch.nn.Parameter]]:
    with parallel_state.simulated_layout(tp, pp, pp_rank=pp_rank), torch.device("meta"):
        chunks = [GPTModel(model, None, pre_process=c.is_first, post_process=c.is_last, layer_offset=c.first_layer,
                           num_layers=c.num_layers) for c in chunks_of_rank(model.num_layers, pp, v, pp_rank)]
    return [item for chunk in chunks for item in chunk.canonical_named_parameters()]


@pytest.mark.parametrize("name", CONFIGS)
def test_counts_equal_the_real_model_rank_by_rank(name):
    model = load_model_config(name)
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
