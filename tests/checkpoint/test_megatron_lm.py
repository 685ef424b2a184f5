"""Megatron-LM checkpoints in and out (megalite/checkpoint/megatron_lm), in one process, against Megatron's own
files and logits (megatron_reference.py: megatron-core 0.16.1 as Megatron-LM uses it). The 4-rank launch checks the
same at TP=2 x PP=2 and EP=2 x PP=2 (tests/multiprocess/test_checkpoint.py).

Tolerance: logits within 1e-5 of the largest Megatron logit (fp32; seen: up to 3.1e-7, the two models add the same
products in another order); an export loads in Megatron to Megatron's logits bit for bit (the same tensors)."""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil

import pytest
import torch

from megalite.checkpoint import CheckpointError, load_pretrained, open_checkpoint
from megalite.checkpoint.megatron_lm import export_megatron, import_megatron, inspect_megatron
from megalite.checkpoint.megatron_lm import args as megatron_lm_args
from megalite.checkpoint.megatron_lm import files
from megalite.checkpoint.megatron_lm.files import LEGACY_FILE, safe_load
from megalite.checkpoint.megatron_lm.tensors import group_qkv, ungroup_qkv
from megalite.config import ModelConfig

megatron_core = pytest.importorskip("megatron.core")

from .megatron_reference import (ITERATION, build_models, loaded_megatron, megatron_args,  # noqa: E402
                                 megatron_layout, megatron_logits, save_megatron)

TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
VOCAB = 101   # Megatron's NullTokenizer of --vocab-size 100 adds its EOD
RELATIVE = 1e-5
FORMATS = ("torch_dist", "torch")
# Each style once: GPT-3 (learned positions, LayerNorm, biases, tied), Llama (rope, RMSNorm, SwiGLU, GQA, untied),
# Qwen-MoE (q/k/v bias-free MoE with a gated shared expert, sigmoid router and expert bias; here with DeepSeek-V3's
# group-limited routing: each token's 2 experts from the best of 2 groups), and a Mixtral whose first and third
# layers are dense (torch_dist stores those layers' places in the expert keys empty).
CASES = {"gpt3": {}, "llama": {}, "qwen_moe": {"moe_router_num_groups": 2, "moe_router_group_topk": 1},
         "mixtral_dense_layers": {"moe_layer_freq": [0, 1, 0, 1]}}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module")
def megatron_saves(tmp_path_factory):
    """case -> (Megatron's logits, {format: its --save directory}), written by Megatron's own models."""
    saves = {}
    for case, overrides in CASES.items():
        style = case.split("_dense")[0]
        root = tmp_path_factory.mktemp(case)
        args = megatron_args(style, **overrides)
        with megatron_layout(args):
            models = build_models(args)
            logits = megatron_logits(args, models, TOKENS)
            for fmt in FORMATS:
                save_megatron(megatron_args(style, ckpt_format=fmt, **overrides), models, root / fmt)
        saves[case] = (logits, {fmt: root / fmt for fmt in FORMATS})
    return saves


@pytest.mark.parametrize("case", CASES)
def test_import_gives_megatrons_logits_and_the_export_loads_in_megatron(case, megatron_saves, tmp_path):
    expected, saves = megatron_saves[case]
    for fmt, export_fmt in (("torch_dist", "torch"), ("torch", "torch_dist")):
        imported = import_megatron(saves[fmt], tmp_path / f"from_{fmt}", progress=False)
        assert (imported.format, imported.iteration, imported.tokenizer) == (fmt, ITERATION, None)
        with torch.no_grad():
            logits = load_pretrained(imported.path)(TOKENS)
        assert logits.shape[-1] == VOCAB
        assert _relative(logits, expected[..., :VOCAB]) < RELATIVE, (fmt, _relative(logits, expected[..., :VOCAB]))
        out = tmp_path / f"to_{export_fmt}_from_{fmt}"
        _, flags = export_megatron(imported.path, out, export_fmt, progress=False)
        with loaded_megatron(out, flags=flags) as (args, models):
            assert args.ckpt_format == export_fmt
            torch.testing.assert_close(megatron_logits(args, models, TOKENS)[..., :VOCAB], expected[..., :VOCAB],
                                       rtol=0, atol=0)


def test_the_import_reads_megatrons_model_options(megatron_saves, tmp_path):
    model = open_checkpoint(import_megatron(megatron_saves["qwen_moe"][1]["torch"], tmp_path, progress=False)
                            .path).manifest.megalite_config().model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.vocab_size) == (4, 64, 4, VOCAB)
    assert (model.position_embedding_type, model.normalization, model.swiglu, model.disable_bias_linear) == \
        ("rope", "RMSNorm", True, True)
    assert (model.group_query_attention, model.num_query_groups, model.untie_embeddings_and_output_weights) == \
        (True, 2, True)
    assert (model.num_experts, model.moe_router_topk, model.moe_ffn_hidden_size) == (4, 2, 64)
    assert (model.moe_shared_expert_intermediate_size, model.moe_shared_expert_gate) == (96, True)
    assert (model.moe_router_score_function, model.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (model.moe_router_num_groups, model.moe_router_group_topk) == (2, 1)
    assert model.make_vocab_size_divisible_by == 8


def test_transformer_engine_spelling_of_a_legacy_file_reads_the_same(megatron_saves, tmp_path):
    """Megatron's default layer spec (Transformer Engine) stores the norms inside the next linear."""
    expected, saves = megatron_saves["llama"]
    source = tmp_path / "te"
    shutil.copytree(saves["torch"], source)
    path = source / f"iter_{ITERATION:07d}" / "mp_rank_00" / LEGACY_FILE
    state = torch.load(path, weights_only=False)
    renamed = {}
    for name, value in state["model"].items():
        name = name.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
        renamed[name.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")] = value
    assert renamed.keys() != state["model"].keys()
    state["model"] = renamed
    torch.save(state, path)
    with torch.no_grad():
        logits = load_pretrained(import_megatron(source, tmp_path / "out", progress=False).path)(TOKENS)
    assert _relative(logits, expected[..., :VOCAB]) < RELATIVE


def test_inspect_shows_the_args_and_whole_tensors(megatron_saves):
    text = inspect_megatron(megatron_saves["llama"][1]["torch_dist"])
    assert "format: torch_dist" in text and f"iteration: {ITERATION}" in text and "swiglu=True" in text
    assert re.search(r"decoder\.layers\.3\.self_attention\.linear_qkv\.weight +\[128, 64\]", text), text


@pytest.mark.parametrize("name, value, flag", [("squared_relu", True, "--squared-relu"),
                                               ("multi_latent_attention", True, "--multi-latent-attention"),
                                               ("window_size", (16, 0), "--window-size"),
                                               ("mtp_num_layers", 1, "--mtp-num-layers"),
                                               ("activation_func_clamp_value", 7.0, "--activation-func-clamp-value"),
                                               ("position_embedding_type", "mrope", "--position-embedding-type")])
def test_what_megalite_cannot_compute_is_refused_by_its_flag(megatron_saves, tmp_path, name, value, flag):
    source = tmp_path / "changed"
    shutil.copytree(megatron_saves["llama"][1]["torch_dist"], source)
    common_file = source / f"iter_{ITERATION:07d}" / "common.pt"
    common = torch.load(common_file, weights_only=False)
    setattr(common["args"], name, value)
    torch.save(common, common_file)
    converted = {"window_size": "converts no such model", "activation_func_clamp_value": "converts no such model",
                 "position_embedding_type": "megalite has"}.get(name, "no such option")
    with pytest.raises(CheckpointError, match=f"{flag}.*{converted}"):
        import_megatron(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, message", [
    ({"window_size": "7,0"}, "window_size='7,0': megalite exports no sliding window to Megatron-LM"),
    ({"softmax_type": "off-by-one"}, "softmax_type='off-by-one': megalite exports no attention sink to Megatron-LM"),
    ({"multi_latent_attention": True}, "multi_latent_attention=True: megalite exports no multi-latent attention to "
                                       "Megatron-LM"),
    ({"mtp_num_layers": 1, "position_embedding_type": "rope"},
     "mtp_num_layers=1: megalite exports no multi-token prediction to Megatron-LM"),
    ({"quick_geglu": True}, "quick_geglu=True: megalite exports no gpt-oss activation"),
    ({"position_embedding_type": "rope", "use_rope_scaling": True, "rope_scaling_type": "llama3",
      "yarn_unrounded_correction_range": True}, "yarn_unrounded_correction_range=True: Megatron's rope scaling fixes"),
    ({"sandwich_norm": True}, "sandwich_norm=True: Megatron-LM's GPT has no flag for it"),
    ({"softmax_scale": 0.125}, "softmax_scale=0.125: Megatron-LM's GPT has no flag for it"),
    ({"gated_linear_unit": True}, "gated_linear_unit=True: Megatron-LM's GPT has no flag for it"),
])
def test_a_sliding_window_or_a_sink_is_not_exported_to_megatron(option, message):
    """Megatron's window and softmax type are refused on import (above), and megalite's on export; so are Gemma 3's
    options, which Megatron-LM has no flags for."""
    from megalite.config.dims import ParallelDims   # noqa: PLC0415

    with pytest.raises(CheckpointError, match=message):
        megatron_lm_args.megatron_args(ModelConfig(**option), ParallelDims(1), None, iteration=1,
                                       consumed_samples=0, ckpt_format="torch", dtype=torch.float32)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_linear_and_yarn_rope_scaling_are_not_exported_to_megatron(kind):
    """Megatron's GPT scales rope as Llama 3 only (its YaRN is multi-latent attention's)."""
    from megalite.config.dims import ParallelDims   # noqa: PLC0415

    model = ModelConfig(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_type=kind)
    with pytest.raises(CheckpointError, match=f"rope_scaling_type='{kind}': Megatron's rope scaling fixes it at "
                                              f"'llama3'"):
        megatron_lm_args.megatron_args(model, ParallelDims(1), None, iteration=1, consumed_samples=0,
                                       ckpt_format="torch", dtype=torch.float32)


def test_a_missing_or_misshaped_tensor_is_named(megatron_saves, tmp_path):
    source = tmp_path / "cut"
    shutil.copytree(megatron_saves["llama"][1]["torch"], source)
    path = source / f"iter_{ITERATION:07d}" / "mp_rank_00" / LEGACY_FILE
    state = torch.load(path, weights_only=False)
    del state["model"]["decoder.layers.2.mlp.linear_fc2.weight"]
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.linear_fc2\.weight"):
        import_megatron(source, tmp_path / "a", progress=False)
    state["model"]["decoder.layers.2.mlp.linear_fc2.weight"] = torch.zeros(64, 64)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.linear_fc2\.weight.*\[64, 64\].*\[64, 128\]"):
        import_megatron(source, tmp_path / "b", progress=False)


def test_pretrain_gpt_load_of_a_megatron_directory_names_the_import(megatron_saves):
    for fmt in FORMATS:
        save = megatron_saves["llama"][1][fmt]
        for load in (save, save / f"iter_{ITERATION:07d}"):
            with pytest.raises(CheckpointError, match=f"a Megatron-LM checkpoint \\({fmt} format\\); import it first: "
                                                      f"python tools/convert_checkpoint.py import-megatron"):
                open_checkpoint(load)


class _Exploit:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_reading_a_pickle_runs_no_code_from_it(tmp_path):
    exploit = _Exploit()
    exploit.marker = tmp_path / "ran"
    torch.save({"args": argparse.Namespace(num_layers=2, dtype=torch.bfloat16), "payload": exploit},
               tmp_path / "file.pt")
    loaded = safe_load(tmp_path / "file.pt")
    assert loaded["args"] == argparse.Namespace(num_layers=2, dtype=torch.bfloat16)
    assert not (tmp_path / "ran").exists() and type(loaded["payload"]).__name__ == "system"
    (tmp_path / "bad.pt").write_bytes(pickle.dumps({"a": 1})[:5])
    with pytest.raises(CheckpointError, match="bad.pt: unreadable"):
        safe_load(tmp_path / "bad.pt")


def test_qkv_regrouping_is_megatrons_per_group_order():
    """Megatron's rows for group g: its query heads, then its key head, then its value head."""
    model = ModelConfig(hidden_size=8, num_attention_heads=4, group_query_attention=True, num_query_groups=2)
    head = 2
    q, k, v = torch.arange(4).repeat_interleave(head), 10 + torch.arange(2).repeat_interleave(head), \
        20 + torch.arange(2).repeat_interleave(head)
    grouped = group_qkv(torch.cat([q, k, v]), model)
    assert grouped.view(2, 4, head)[:, :, 0].tolist() == [[0, 1, 10, 20], [2, 3, 11, 21]]
    assert torch.equal(ungroup_qkv(grouped, model), torch.cat([q, k, v]))


def test_the_true_vocabulary_comes_from_the_tokenizer_the_args_name(hf_tokenizer_dir, tmp_path):
    args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_tokenizer_dir),
                              vocab_size=None, padded_vocab_size=1024)
    tokenizer, vocab, notes = megatron_lm_tokenizer(args)
    assert tokenizer is not None and vocab == tokenizer.vocab_size and notes == []
    args.tokenizer_model = str(tmp_path / "elsewhere")
    tokenizer, vocab, notes = megatron_lm_tokenizer(args)
    assert tokenizer is None and vocab == 1024 and "not loaded" in notes[0] and "padded 1024" in notes[0]


def megatron_lm_tokenizer(args):
    from megalite.checkpoint.megatron_lm import _tokenizer
    return _tokenizer(args)


def test_an_export_carries_the_tokenizer_and_says_the_flags_megatron_needs(hf_tokenizer_dir, tmp_path):
    from megalite.checkpoint.convert import import_hf
    from .test_tools import _hf_gpt2_with_tokenizer

    hf = tmp_path / "hf"
    _hf_gpt2_with_tokenizer(hf, hf_tokenizer_dir, ("tokenizer.json",))
    directory, flags = export_megatron(import_hf(hf, tmp_path / "ckpt", progress=False), tmp_path / "out",
                                       progress=False)
    args = files.open_megatron(tmp_path / "out").args()
    assert args.tokenizer_type == "HuggingFaceTokenizer" and (tmp_path / "out" / "tokenizer").is_dir()
    assert os.path.isfile(os.path.join(args.tokenizer_model, "tokenizer.json"))
    assert "--vocab-size" not in " ".join(flags)
    layernorm = ModelConfig(layernorm_epsilon=1e-6, qk_layernorm=True, openai_gelu=True)
    assert megatron_lm_args.flags_not_taken(layernorm) == ["--norm-epsilon 1e-06", "--openai-gelu", "--qk-layernorm"]
    with pytest.raises(CheckpointError, match="exists"):
        export_megatron(tmp_path / "ckpt", tmp_path / "out", progress=False)
    with pytest.raises(CheckpointError, match="cannot split 4 heads over TP 3"):
        export_megatron(tmp_path / "ckpt", tmp_path / "out3", tp=3, progress=False)


def test_the_tool_imports_exports_and_inspects(megatron_saves, tmp_path, capsys):
    from .test_tools import _tool

    convert = _tool("convert_checkpoint").main
    save = megatron_saves["llama"][1]["torch"]
    assert convert(["import-megatron", "--input", str(save), "--save", str(tmp_path / "in"), "--quiet"]) == 0
    assert f"torch format, Megatron iteration {ITERATION}; no tokenizer" in capsys.readouterr().out
    assert convert(["export-megatron", "--load", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--quiet"]) == 0
    assert (f"Megatron-LM loads it with: --load {tmp_path / 'out'} --use-checkpoint-args --no-load-optim --no-load-rng "
            f"--vocab-size 100") in capsys.readouterr().out
    assert convert(["inspect", "--load", str(tmp_path / "out")]) == 0
    assert "tensor_model_parallel_size=2" in capsys.readouterr().out
    assert convert(["import-megatron", "--input", str(tmp_path / "in"), "--save", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint: error:") and "not a Megatron-LM checkpoint" in err and "\n" not in err


@pytest.mark.parametrize("case, layout", [("gpt3", dict(tp=2, pp=2, virtual_stages=2)),
                                          ("qwen_moe", dict(tp=2, pp=2, virtual_stages=2, ep=2)),
                                          ("mixtral_dense_layers", dict(tp=2, pp=2, ep=4))])
def test_an_export_at_any_layout_imports_back_to_the_same_tensors(case, layout, megatron_saves, tmp_path):
    """Writing Megatron's shards (TP cuts of [gate; up] halves, pipeline and virtual stages, expert ranks) and reading
    them back is the identity, in both formats (Megatron loads these layouts in the 4-rank launch)."""
    from megalite.checkpoint.convert import full_tensors

    original = import_megatron(megatron_saves[case][1]["torch_dist"], tmp_path / "original", progress=False).path
    expected = full_tensors(open_checkpoint(original))
    for fmt in FORMATS:
        directory, _ = export_megatron(original, tmp_path / fmt, fmt, progress=False, **layout)
        if fmt == "torch":
            ranks = {p.name for p in directory.iterdir()}
            assert len(ranks) == layout["tp"] * layout["pp"] * layout.get("ep", 1), ranks
            if "virtual_stages" in layout:
                assert set(safe_load(directory / sorted(ranks)[0] / LEGACY_FILE)) >= {"model0", "model1"}
        back = full_tensors(open_checkpoint(import_megatron(tmp_path / fmt, tmp_path / f"{fmt}_back",
                                                            progress=False).path))
        assert back.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(back[name], tensor), (fmt, name)
