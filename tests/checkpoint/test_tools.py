"""tools/convert_checkpoint.py and tools/generate.py as scripts use them, and the sampling rules of generation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megalite.generation import generate, next_token

ROOT = Path(__file__).resolve().parent.parent.parent


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inspect_prints_iteration_layout_config_and_shapes(saved, capsys):
    assert _tool("convert_checkpoint").main(["inspect", "--load", str(saved)]) == 0
    out = capsys.readouterr().out
    for expected in ["iteration: 3", "consumed samples: 24", "saved at: TP=1 x PP=1 x DP=1",
                     "optimizer state: yes (Adam step 3)", "rng state: cpu, tensor_parallel",
                     "model: num_layers=2, hidden_size=64", "embedding.word.weight", "[301, 64]",
                     "layers.1.self_attention.linear_qkv.weight", "[192, 64]"]:
        assert expected in out, expected


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert _tool("convert_checkpoint").main(["export-hf", "--load", str(tmp_path), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_checkpoint: error:") and "no checkpoint there" in err and "\n" not in err


def test_import_hf_then_pretrain_gpt_finetunes_it(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=301, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     activation_function="gelu", bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    convert = _tool("convert_checkpoint")
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert pretrain_gpt.main(["data=mock", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
                              "--vocab-size", "301", "--train-iters", "2", "--eval-interval", "0", "--finetune",
                              "--load", str(tmp_path / "ckpt")]) == 0
    assert "--finetune: model weights only" in capsys.readouterr().out


def test_generate_with_the_checkpoints_tokenizer(corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert pretrain_gpt.main(["--data-path", str(corpus.prefix), "--tokenizer-model", str(corpus.tokenizer_model),
                              "model=gpt_tiny", "--train-iters", "2", "--eval-interval", "0",
                              "--save", str(ckpt)]) == 0
    assert (ckpt / "iter_0000002" / "tokenizer.model").is_file()   # generate.py needs no --tokenizer-model
    capsys.readouterr()
    generate_tool = _tool("generate")
    assert generate_tool.main(["--load", str(ckpt), "--prompt", "the quick", "--max-new-tokens", "5"]) == 0
    greedy = capsys.readouterr().out
    assert generate_tool.main(["--load", str(ckpt), "--prompt", "the quick", "--max-new-tokens", "5",
                               "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9"]) == 0
    assert greedy.strip() and capsys.readouterr().out.strip()


def test_generate_with_token_ids_when_there_is_no_tokenizer(saved, capsys):
    assert _tool("generate").main(["--load", str(saved), "--prompt", "1 2 3", "--max-new-tokens", "4"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 4 and all(0 <= int(i) < 301 for i in ids)


def test_sampling_rules():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert next_token(logits) == 1                                       # greedy
    generator = torch.Generator().manual_seed(0)
    assert {next_token(logits, 1.0, top_k=1, generator=generator) for _ in range(20)} == {1}
    assert {next_token(logits, 1.0, top_p=0.5, generator=generator) for _ in range(20)} == {1}   # p(1) = 0.66
    assert {next_token(logits, 5.0, top_k=2, generator=generator) for _ in range(50)} == {1, 2}
    calls = []

    def model(tokens):
        calls.append(tokens.shape[1])
        return torch.nn.functional.one_hot(torch.full(tokens.shape, 7), 10).float()

    assert generate(model, [1, 2, 3], max_new_tokens=5, max_positions=4, eod=7) == [7]
    assert generate(model, [1, 2, 3], max_new_tokens=3, max_positions=4) == [7, 7, 7] and max(calls) == 4
