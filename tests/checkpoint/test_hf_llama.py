"""Hugging Face Llama, Llama 3.1-style rope scaling, Qwen2, Qwen3 and Mistral conversion: logits agree both ways
(grouped-query attention, odd vocabulary 301, tied and untied output layer, q/k/v biases, Qwen3's per-head q/k norms
and head_dim), greedy generation (KV cache or not) equals transformers', the tool picks the architecture by itself,
and what megalite cannot compute is refused in one line naming the field.

A random model of each architecture (local config, nothing downloaded) imported into megalite gives the same logits;
a megalite model of that shape trained a few steps, exported, gives the same logits in transformers. Tolerance RTOL
(1e-5) relative to the largest logit (measured: below 1e-6).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch

from megalite import load_pretrained
from megalite.checkpoint import CheckpointError, open_checkpoint
from megalite.checkpoint.convert import export_hf, hf_architecture, import_hf
from megalite.checkpoint.hf_llama import LLAMA as LLAMA_ARCHITECTURE
from megalite.checkpoint.hf_llama import MISTRAL, QWEN2, QWEN3, check_exportable, model_config_from
from megalite.config import ModelConfig
from megalite.model.rotary import rope_scaling

from ..data.helpers import HF_VOCAB_SIZE, MULTILINGUAL
from ..helpers import tiny_config
from .helpers import (RTOL, VOCAB, assert_export_matches, assert_greedy_matches, assert_import_matches,
                      perturb_and_save, random_tokens, relative, train_and_save)
from .test_tools import _tool

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
         "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 176, "rotary_base": 500000}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
ROPE_SCALING = {"use_rope_scaling": True, "rope_scaling_factor": 8.0,
                "rope_scaling_original_max_position_embeddings": 16}
# YaRN over 32 tokens from an original 8: a ramp over channels 1 to 3 of 8, DeepSeek's mscale ratio (1.05); linear.
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 4.0,
             "beta_slow": 0.5, "mscale": 1.5, "mscale_all_dim": 1.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.5}
YARN_SCALING = {"use_rope_scaling": True, "rope_scaling_type": "yarn", "rope_scaling_factor": 4.0,
                "rope_scaling_original_max_position_embeddings": 8, "beta_fast": 4.0, "beta_slow": 0.5}
LINEAR_SCALING = {"use_rope_scaling": True, "rope_scaling_type": "linear", "rope_scaling_factor": 2.5}
# model_type -> (config class, model class)
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
# A megalite Qwen3: per-head q/k norms and, as in Qwen3-32B, a head dimension other than hidden / heads (64 / 4).
QWEN3_OPTIONS = {"qk_layernorm": True, "kv_channels": 32}


def _hf_config(model_type: str = "llama", tie: bool = False, **overrides):
    options = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
               "rope_theta": 500000.0, "tie_word_embeddings": tie, "bos_token_id": VOCAB - 1,
               "eos_token_id": VOCAB - 1}
    if model_type == "mistral":
        options["sliding_window"] = None
    if model_type == "qwen3":
        # Qwen3Config's default head_dim is 128 whatever the hidden size; no end of document, which transformers'
        # generate would stop at (megalite's does only at its tokenizer's, and these models have none)
        options.update(head_dim=32, bos_token_id=None, eos_token_id=None)
    return getattr(transformers, HF_CLASSES[model_type][0])(**{**options, **overrides})


def _random_model(directory, model_type: str = "llama", tie: bool = False, **overrides):
    torch.manual_seed(7)
    model_class = getattr(transformers, HF_CLASSES[model_type][1])
    return perturb_and_save(model_class(_hf_config(model_type, tie, **overrides)).eval(), directory)


@pytest.mark.parametrize("model_type, tie, overrides", [
    ("llama", True, {}), ("llama", False, {"rope_scaling": LLAMA3_ROPE}), ("qwen2", True, {}), ("qwen2", False, {}),
    ("mistral", False, {}), ("mistral", True, {"sliding_window": 32}),   # a window as long as the context
    ("qwen3", False, {}), ("qwen3", True, {"head_dim": 16}),
    ("mistral", False, {"sliding_window": 8}),   # the query and 7 before it, of 32 tokens
    ("qwen2", False, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),   # layer 1 only
    ("llama", False, {"rope_scaling": YARN_ROPE}), ("qwen2", False, {"rope_scaling": LINEAR_ROPE}),
    ("qwen3", False, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}),
    ("mistral", False, {"rope_scaling": LINEAR_ROPE}),
], ids=["llama-tied", "llama3-rope-scaling", "qwen2-tied", "qwen2", "mistral", "mistral-window-32", "qwen3",
        "qwen3-tied-head-dim-16", "mistral-window-8", "qwen2-window-8-from-layer-1", "llama-yarn-mscale",
        "qwen2-linear", "qwen3-yarn", "mistral-linear"])
def test_import_gives_the_same_logits_and_generation(tmp_path, model_type, tie, overrides):
    hf = _random_model(tmp_path / "hf", model_type, tie, **overrides)
    model = assert_import_matches(hf, tmp_path / "hf", tmp_path / "ckpt", f"{model_type}, tied={tie}, {overrides}")
    imported = model.config.model
    assert (imported.query_groups, imported.rotary_base, imported.untie_embeddings_and_output_weights) == \
        (2, 500000, not tie)
    assert imported.add_qkv_bias == (model_type == "qwen2") and imported.use_rope_scaling == bool(overrides.get(
        "rope_scaling"))
    assert imported.qk_layernorm == (model_type == "qwen3")
    kind = overrides.get("rope_scaling", {}).get("rope_type", "llama3")
    assert imported.rope_scaling_type == kind
    if kind == "yarn":   # each parameter as transformers reads it: mscale and mscale_all_dim only together
        attention = hf.model.rotary_emb.attention_scaling
        assert attention != 1 and attention == rope_scaling(imported).attention_factor
        assert (imported.beta_fast, imported.beta_slow, imported.mscale) == (
            (4.0, 0.5, 1.5) if model_type == "llama" else (32.0, 1.0, 1.0))
    window = overrides.get("sliding_window", 32) < 32 and {"window_size": "7,0", "window_attn_skip_freq": None}
    if window and model_type == "qwen2":
        window["window_attn_skip_freq"] = "[0,1]"
    assert (imported.window_size, imported.window_attn_skip_freq) == ((window or {}).get("window_size"),
                                                                      (window or {}).get("window_attn_skip_freq"))
    assert_greedy_matches(model, hf, [5, 17, 300, 2], 24)   # 28 tokens: windows slide past the prompt


@pytest.mark.parametrize("options, architecture, expected", [
    ({"untie_embeddings_and_output_weights": False}, None, "LlamaForCausalLM"),
    ({"untie_embeddings_and_output_weights": True, **ROPE_SCALING}, None, "LlamaForCausalLM"),
    ({"untie_embeddings_and_output_weights": False, "add_qkv_bias": True}, None, "Qwen2ForCausalLM"),
    ({"untie_embeddings_and_output_weights": True, "add_qkv_bias": True}, None, "Qwen2ForCausalLM"),
    ({"untie_embeddings_and_output_weights": True}, "MistralForCausalLM", "MistralForCausalLM"),
    ({"untie_embeddings_and_output_weights": True, **QWEN3_OPTIONS}, None, "Qwen3ForCausalLM"),
    ({"untie_embeddings_and_output_weights": False, "qk_layernorm": True}, None, "Qwen3ForCausalLM"),
    ({"untie_embeddings_and_output_weights": True, "window_size": "(7, 0)"}, None, "MistralForCausalLM"),
    ({"untie_embeddings_and_output_weights": False, "add_qkv_bias": True, "window_size": "7,0",
      "window_attn_skip_freq": "[0,1]"}, None, "Qwen2ForCausalLM"),
    ({"untie_embeddings_and_output_weights": True, **YARN_SCALING, "mscale": 0.8, "mscale_all_dim": 0.5}, None,
     "LlamaForCausalLM"),
    ({"untie_embeddings_and_output_weights": False, **YARN_SCALING, "rope_scaling_attention_factor": 1.3,
      **QWEN3_OPTIONS}, None, "Qwen3ForCausalLM"),
    ({"untie_embeddings_and_output_weights": True, **LINEAR_SCALING, "add_qkv_bias": True}, None,
     "Qwen2ForCausalLM"),
    ({"untie_embeddings_and_output_weights": True, **LINEAR_SCALING}, "MistralForCausalLM", "MistralForCausalLM"),
], ids=["llama-tied", "llama3-rope-scaling", "qwen2-tied", "qwen2", "mistral", "qwen3", "qwen3-tied-head-dim-16",
        "mistral-window-8", "qwen2-window-8-layer-1", "llama-yarn-mscale", "qwen3-yarn-attention-factor",
        "qwen2-linear", "mistral-linear"])
def test_export_gives_the_same_logits(tmp_path, options, architecture, expected):
    cfg = tiny_config(model={**LLAMA, **options}, data={"eval_interval": 0})
    train_and_save(cfg, tmp_path / "ckpt", 3)
    hf = assert_export_matches(tmp_path / "ckpt", tmp_path / "hf", str(options), architecture)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert type(hf).__name__ == expected
    tie = not options["untie_embeddings_and_output_weights"]
    assert (config["vocab_size"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (VOCAB, 2, tie)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    assert rope.get("rope_type", "default") == (options.get("rope_scaling_type", "llama3")
                                                if options.get("use_rope_scaling") else "default")
    if options.get("use_rope_scaling"):   # and back: the same options
        reimported = model_config_from(config)
        assert {k: getattr(reimported, k) for k in options if "rope" in k or "scale" in k or "beta" in k} == \
            {k: v for k, v in options.items() if "rope" in k or "scale" in k or "beta" in k}
    if expected == "Qwen3ForCausalLM":
        assert (config["head_dim"], config["attention_bias"], config["use_sliding_window"]) == \
            (options.get("kv_channels", 16), False, False)
    window = 8 if "window_size" in options else None   # HF's sliding_window counts the query itself
    assert (config.get("sliding_window"), getattr(hf.config, "sliding_window", None)) == (window, window)
    if "window_attn_skip_freq" in options:
        assert (hf.config.max_window_layers, hf.config.layer_types) == (1, ["full_attention", "sliding_attention"])


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_head_dim_imports_as_kv_channels_with_the_same_logits(tmp_path, model_type):
    """A head_dim other than hidden / heads (Qwen3-style) is megalite's --kv-channels, both ways; Qwen2's config
    has no head_dim, so such a model does not export as one."""
    hf = _random_model(tmp_path / "hf", model_type, head_dim=32)
    model = assert_import_matches(hf, tmp_path / "hf", tmp_path / "ckpt", f"{model_type} head_dim 32")
    assert model.config.model.kv_channels == 32 and model.config.model.head_dim == 32
    export_hf(tmp_path / "ckpt", tmp_path / "hf2", architecture=HF_CLASSES[model_type][1])
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["head_dim"] == 32
    with pytest.raises(CheckpointError, match="kv_channels 32 is not hidden size / heads"):
        check_exportable(dataclasses.replace(model.config.model, add_qkv_bias=True), QWEN2)


def test_multi_head_llama_round_trips_without_grouping(tmp_path):
    """num_key_value_heads == heads imports as plain multi-head attention, and exports back the same."""
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(_hf_config(num_key_value_heads=4)).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not open_checkpoint(tmp_path / "ckpt").manifest.megalite_config().model.group_query_attention
    export_hf(tmp_path / "ckpt", tmp_path / "hf2")
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["num_key_value_heads"] == 4


def test_tool_picks_the_architecture_and_round_trips(tmp_path, capsys):
    _random_model(tmp_path / "hf", "qwen2", tie=False)
    convert = _tool("convert_checkpoint")
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert convert.main(["inspect", "--load", str(tmp_path / "ckpt")]) == 0
    assert "add_qkv_bias=True" in capsys.readouterr().out
    assert convert.main(["export-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
                         "--dtype", "bfloat16"]) == 0
    assert "Qwen2ForCausalLM" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.dtype == torch.bfloat16
    assert convert.main(["export-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "llama"),
                         "--architecture", "LlamaForCausalLM"]) == 2
    assert "cannot export as LlamaForCausalLM: model option add_qkv_bias=True (exports as Qwen2ForCausalLM)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("model_type, overrides, message", [
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope scaling 'dynamic' is not supported"),
    ("llama", {"rope_scaling": {**LLAMA3_ROPE, "partial_rotary_factor": 0.5}},
     "rope parameter partial_rotary_factor=0.5 is not supported"),
    ("llama", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True is not supported"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["chunked_attention"] * 2},
     "layer_types 'chunked_attention' is not supported"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     "use_sliding_window with sliding_window 16 is not supported: it is shorter than max_position_embeddings 32"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
               "max_window_layers": 2}, "use_sliding_window with sliding_window 16 is not supported"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("qwen3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                "original_max_position_embeddings": 16}}, "rope scaling 'longrope' is not supported"),
], ids=["llama-dynamic", "llama-partial-rotary", "llama-attention-bias", "llama-mlp-bias", "llama-gelu",
        "qwen2-layer-types", "qwen3-window", "qwen3-layer-types-window", "qwen3-attention-bias", "qwen3-longrope"])
def test_tool_refuses_what_megalite_would_compute_differently(tmp_path, capsys, model_type, overrides, message):
    _hf_config(model_type, **overrides).save_pretrained(tmp_path / "hf")   # refused on reading config.json
    convert = _tool("convert_checkpoint")
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint: error:") and message in err and "\n" not in err
    assert not (tmp_path / "ckpt").exists()


def test_config_formats_and_windows_that_cover_the_context():
    legacy = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 500000.0,
              "rope_scaling": None}
    current = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
               "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert model_config_from(legacy).rotary_base == model_config_from(current).rotary_base == 500000
    scaled = model_config_from({**legacy, "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}})
    assert (scaled.use_rope_scaling, scaled.rope_scaling_factor,
            scaled.rope_scaling_original_max_position_embeddings) == (True, 32.0, 16)
    linear = model_config_from({**legacy, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (linear.use_rope_scaling, linear.rope_scaling_type, linear.rope_scaling_factor) == (True, "linear", 2.0)
    # yarn's original context: the config's own key first (Phi-3 style), then the rope parameter's, then the context
    yarn = {"rope_type": "yarn", "factor": 4.0, "mscale": 2.0}   # mscale alone: transformers ignores it
    assert (model_config_from({**current, "max_position_embeddings": 64, "rope_parameters": {
        **current["rope_parameters"], **yarn}}).rope_scaling_original_max_position_embeddings,
            model_config_from({**legacy, "rope_scaling": {**yarn, "original_max_position_embeddings": 16},
                               "original_max_position_embeddings": 8}).rope_scaling_original_max_position_embeddings,
            model_config_from({**legacy, "rope_scaling": yarn}).mscale) == (64, 8, 1.0)
    with pytest.raises(CheckpointError, match="rope scaling 'dynamic' is not supported"):
        model_config_from({**legacy, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(CheckpointError, match="rope scaling 'yarn' without factor"):
        model_config_from({**legacy, "rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(CheckpointError, match="rope scaling 'llama3' without low_freq_factor"):
        model_config_from({**legacy, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    # Mistral's default window (4096) is W - 1 = 4095 tokens before each query in its default context, an explicit
    # null is no window; Qwen2's window applies only with use_sliding_window, from layer max_window_layers on.
    mistral = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4}
    assert (model_config_from(mistral).window_size, model_config_from(mistral).window_attn_skip_freq) == ("4095,0", None)
    assert model_config_from({**mistral, "sliding_window": None}).window_size is None
    qwen2 = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
             "max_position_embeddings": 64, "use_sliding_window": True, "sliding_window": 16}
    assert model_config_from({**qwen2, "max_window_layers": 2}).window_size is None   # no layer slides
    assert model_config_from({**qwen2, "use_sliding_window": False}).window_size is None
    assert model_config_from({**qwen2, "max_window_layers": 0}).attention_windows() == [15, 15]


def test_export_picks_the_architecture_and_refuses_half_llamas():
    assert hf_architecture(ModelConfig()) == "GPT2LMHeadModel"
    assert hf_architecture(tiny_config(model=LLAMA).model) == "LlamaForCausalLM"
    assert hf_architecture(tiny_config(model={**LLAMA, "add_qkv_bias": True}).model) == "Qwen2ForCausalLM"
    check_exportable(tiny_config(model=LLAMA).model)
    check_exportable(tiny_config(model={**LLAMA, "add_qkv_bias": True, **ROPE_SCALING}).model, QWEN2)
    for option, value in [("position_embedding_type", "learned_absolute"), ("normalization", "LayerNorm"),
                          ("swiglu", False), ("disable_bias_linear", False)]:
        half = tiny_config(model={**LLAMA, option: value}).model
        assert hf_architecture(half) == "LlamaForCausalLM"
        with pytest.raises(CheckpointError, match=f"{option}={value!r} .*exports as GPT2LMHeadModel"):
            check_exportable(half)
    with pytest.raises(CheckpointError, match="add_qkv_bias=False \\(exports as LlamaForCausalLM or Mistral"):
        check_exportable(tiny_config(model=LLAMA).model, QWEN2)
    qwen3 = tiny_config(model={**LLAMA, **QWEN3_OPTIONS}).model
    assert hf_architecture(qwen3) == "Qwen3ForCausalLM"
    check_exportable(qwen3, QWEN3)
    for model, architecture, message in [
            (qwen3, LLAMA_ARCHITECTURE, "qk_layernorm=True (exports as Qwen3ForCausalLM)"),
            (qwen3, QWEN2, "qk_layernorm=True (exports as Qwen3ForCausalLM)"),
            (tiny_config(model=LLAMA).model, QWEN3, "qk_layernorm=False (exports as LlamaForCausalLM, Mistral"),
            (dataclasses.replace(qwen3, add_qkv_bias=True), QWEN3,
             "add_qkv_bias=True (Qwen3ForCausalLM has no q/k/v biases)")]:
        with pytest.raises(CheckpointError, match=re.escape(f"cannot export as {architecture.name}: model option "
                                                            f"{message}")):
            check_exportable(model, architecture)
    # A window exports as Mistral (every layer) or Qwen2 (global layers first); Llama has none.
    windowed = tiny_config(model={**LLAMA, "window_size": "7,0"}).model
    assert hf_architecture(windowed) == "MistralForCausalLM"
    with pytest.raises(CheckpointError, match="cannot export as LlamaForCausalLM: it has no sliding window"):
        check_exportable(windowed, LLAMA_ARCHITECTURE)
    with pytest.raises(CheckpointError, match="cannot export as Qwen3ForCausalLM: it has no sliding window"):
        check_exportable(dataclasses.replace(windowed, qk_layernorm=True), QWEN3)
    with pytest.raises(CheckpointError, match=r"skip_freq '2' makes layers \[1\] global; Mistral windows every"):
        check_exportable(dataclasses.replace(windowed, window_attn_skip_freq="2"), MISTRAL)
    with pytest.raises(CheckpointError, match=r"'\[1,0\]' makes layers \[1\] global; Qwen2's max_window_layers"):
        check_exportable(dataclasses.replace(windowed, add_qkv_bias=True, window_attn_skip_freq="[1,0]"), QWEN2)


def test_qwen3_norms_map_both_ways_exactly(tmp_path):
    """Perturbed q_norm, k_norm and layer norms (each its own scale) come back bit for bit from HF -> megalite -> HF,
    and the export gives transformers' logits; the config's defaults (head_dim 128 whatever the hidden size) are
    Qwen3's."""
    hf = _random_model(tmp_path / "hf", "qwen3")
    with torch.no_grad():   # norms far from one and from each other, so a swapped or dropped one shows in the logits
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.mul_(2.0)
            layer.self_attn.k_norm.weight.mul_(0.5)
            layer.input_layernorm.weight.mul_(1.5)
    hf.save_pretrained(tmp_path / "hf")
    model = assert_import_matches(hf, tmp_path / "hf", tmp_path / "ckpt", "qwen3, scaled norms")
    assert model.config.model.layernorm_epsilon == 1e-5   # rms_norm_eps, for the q/k norms too
    exported = assert_export_matches(tmp_path / "ckpt", tmp_path / "out", "qwen3, scaled norms")
    theirs, ours = hf.state_dict(), exported.state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    defaults = model_config_from({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_hidden_layers": 2})
    assert (defaults.kv_channels, defaults.qk_layernorm, defaults.add_qkv_bias, defaults.num_query_groups,
            defaults.rotary_base, defaults.layernorm_epsilon) == (128, True, False, 2, 10000, 1e-6)


def test_qwen3_with_a_padded_vocabulary_and_its_tokenizer(tmp_path, hf_tokenizer_dir):
    """Qwen3's embedding has more rows than its tokenizer has ids (151936 for 151669): the import keeps the
    tokenizer's rows, whose logits are transformers'; the export carries the tokenizer for AutoTokenizer and
    generates what transformers generates, stopping at the tokenizer's end of document."""
    torch.manual_seed(8)
    hf = perturb_and_save(transformers.Qwen3ForCausalLM(_hf_config("qwen3", vocab_size=HF_VOCAB_SIZE + 14)).eval(),
                          tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_tokenizer_dir / name, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_pretrained(tmp_path / "ckpt")
    assert model.vocab_size == HF_VOCAB_SIZE and model.config.model.qk_layernorm
    tokens = random_tokens(2, HF_VOCAB_SIZE)
    with torch.no_grad():
        assert relative(model(tokens), hf(tokens).logits[..., :HF_VOCAB_SIZE]) < RTOL
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    ids = model.tokenizer().encode(MULTILINGUAL)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").encode(MULTILINGUAL) == ids
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == "Qwen3ForCausalLM"
    assert_greedy_matches(model, exported, ids[:6], 16)
