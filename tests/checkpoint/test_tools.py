"""tools/convert_checkpoint.py, generate.py and preprocess_data.py as scripts use them (an imported model's tokenizer
carried through preprocessing, training, generation and export), and the rules of generation."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megalite import load_pretrained
from megalite.checkpoint.convert import export_hf, import_hf
from megalite.generation import generate, next_token

from ..data.helpers import HF_VOCAB_SIZE, MULTILINGUAL, generated_documents, write_jsonl
from .helpers import RTOL, perturb_and_save, random_tokens, relative

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


def _hf_gpt2_with_tokenizer(directory: Path, tokenizer_dir: Path, files: tuple[str, ...]):
    """A random GPT2LMHeadModel (OpenAI's tanh GeLU) over the test tokenizer's vocabulary, saved in ``directory``
    with the tokenizer ``files``."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    config = transformers.GPT2Config(vocab_size=HF_VOCAB_SIZE, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    model = perturb_and_save(transformers.GPT2LMHeadModel(config).eval(), directory)
    for name in files:
        shutil.copy(tokenizer_dir / name, directory / name)
    return model


def test_imported_model_trains_and_generates_with_its_tokenizer_then_exports_for_transformers(
        hf_tokenizer_dir, tmp_path, capsys):
    """import-hf takes the tokenizer from the HF folder; preprocess_data tokenizes with it, pretrain_gpt.py trains
    with it (no tokenizer flag: the --load checkpoint's), generate.py continues text with it, and export-hf writes it
    so that AutoTokenizer + AutoModelForCausalLM give the same ids and logits."""
    transformers = pytest.importorskip("transformers")
    _hf_gpt2_with_tokenizer(tmp_path / "hf", hf_tokenizer_dir, ("tokenizer.json", "tokenizer_config.json"))
    convert = _tool("convert_checkpoint")
    assert convert.main(["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "imported")]) == 0
    assert f"tokenizer HuggingFaceTokenizer, {HF_VOCAB_SIZE} ids" in capsys.readouterr().out
    write_jsonl(tmp_path / "docs.jsonl", generated_documents(60, seed=6) + [MULTILINGUAL])
    assert _tool("preprocess_data").main(["--input", str(tmp_path / "docs.jsonl"), "--output-prefix",
                                          str(tmp_path / "docs"), "--tokenizer-type", "HuggingFaceTokenizer",
                                          "--tokenizer-model", str(tmp_path / "hf"), "--append-eod", "--quiet"]) == 0
    assert pretrain_gpt.main(["--data-path", str(tmp_path / "docs"), "--num-layers", "2", "--hidden-size", "64",
                              "--num-attention-heads", "4", "--seq-length", "32", "--openai-gelu",
                              "--train-iters", "2", "--eval-interval", "0", "--load", str(tmp_path / "imported"),
                              "--finetune", "--save", str(tmp_path / "trained")]) == 0
    assert f"vocabulary {HF_VOCAB_SIZE}" in capsys.readouterr().out
    assert _tool("generate").main(["--load", str(tmp_path / "trained"), "--prompt", "the quick brown",
                                   "--max-new-tokens", "8"]) == 0
    continuation = capsys.readouterr().out.removesuffix("\n")
    assert convert.main(["export-hf", "--load", str(tmp_path / "trained"), "--output", str(tmp_path / "out")]) == 0
    assert "a tokenizer for AutoTokenizer" in capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    model = load_pretrained(tmp_path / "trained")
    ids = model.tokenizer().encode(MULTILINGUAL)
    assert tokenizer.encode(MULTILINGUAL) == ids and model.tokenizer().fingerprint() == \
        load_pretrained(tmp_path / "imported").tokenizer().fingerprint()
    with torch.no_grad():
        tokens = torch.tensor([ids[:32]])
        assert relative(hf(tokens).logits, model(tokens)) < RTOL
    prompt = tokenizer("the quick brown", return_tensors="pt")
    generated = hf.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:]) == continuation


def test_gpt2_bpe_files_import_and_export(hf_tokenizer_dir, tmp_path):
    """An HF folder with vocab.json and merges.txt (no tokenizer.json) imports as GPT2BPETokenizer and exports so that
    AutoTokenizer reads it with the same ids."""
    transformers = pytest.importorskip("transformers")
    _hf_gpt2_with_tokenizer(tmp_path / "hf", hf_tokenizer_dir, ("vocab.json", "merges.txt"))
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    tokenizer = load_pretrained(tmp_path / "ckpt").tokenizer()
    assert type(tokenizer).__name__ == "GPT2BPETokenizer"
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").encode(MULTILINGUAL) == \
        tokenizer.encode(MULTILINGUAL)


def test_a_model_padding_its_vocabulary_keeps_the_tokenizers_rows(hf_tokenizer_dir, tmp_path):
    """A Qwen2 whose embedding has more rows than its tokenizer has ids imports with the tokenizer's vocabulary
    (Megatron's true vocabulary size): the logits of those ids are transformers'."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(6)
    config = transformers.Qwen2Config(vocab_size=HF_VOCAB_SIZE + 14, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, tie_word_embeddings=True)
    hf = perturb_and_save(transformers.Qwen2ForCausalLM(config).eval(), tmp_path / "hf")
    shutil.copy(hf_tokenizer_dir / "tokenizer.json", tmp_path / "hf")
    shutil.copy(hf_tokenizer_dir / "tokenizer_config.json", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_pretrained(tmp_path / "ckpt")
    assert model.vocab_size == HF_VOCAB_SIZE
    tokens = random_tokens(2, HF_VOCAB_SIZE)
    with torch.no_grad():
        assert relative(model(tokens), hf(tokens).logits[..., :HF_VOCAB_SIZE]) < RTOL


def test_training_on_data_without_a_tokenizer_needs_one_in_the_checkpoint(saved, corpus, capsys):
    """--data-path with no tokenizer option takes --load's tokenizer; a checkpoint of mock data has none: one line."""
    assert pretrain_gpt.main(["--data-path", str(corpus.prefix), "model=gpt_tiny", "--load", str(saved),
                              "--train-iters", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megalite: error: --data-path needs --tokenizer-type") and "holds no tokenizer" in err


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
    (ckpt / "iter_0000002" / "tokenizer.model").unlink()
    assert generate_tool.main(["--load", str(ckpt), "--prompt", "the quick"]) == 2
    assert "incomplete checkpoint: its tokenizer file tokenizer.model is missing" in capsys.readouterr().err


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

    def model(tokens, cache=None):
        calls.append(tokens.shape[1])
        if cache is not None:
            cache.advance(tokens.shape[1])
        return torch.nn.functional.one_hot(torch.full(tokens.shape, 7), 10).float()

    assert generate(model, [1, 2, 3], max_new_tokens=5, max_positions=4, eod=7) == [7]
    # Without a cache the cropped context each time; with it, the prompt, then one token until the cache is full,
    # then the cropped context again.
    calls.clear()
    assert generate(model, [1, 2, 3], max_new_tokens=3, max_positions=4, use_cache=False) == [7, 7, 7]
    assert calls == [3, 4, 4]
    calls.clear()
    assert generate(model, [1, 2, 3], max_new_tokens=4, max_positions=4) == [7, 7, 7, 7] and calls == [3, 1, 4, 4]


class _ClosedPipe:
    """A stdout whose reader is gone (``tool | head`` once head has read its lines)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    flush = write


def test_a_closed_stdout_ends_the_tools_quietly_with_exit_code_1(saved, monkeypatch, capsys):
    """``inspect | head``: no traceback, nothing on stderr, exit code 1 (Python's recommended handling: the output
    was cut short); the process, whose interpreter flushes stdout again at exit, in test_inspect_into_a_closed_pipe."""
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert _tool("convert_checkpoint").main(["inspect", "--load", str(saved)]) == 1
    assert _tool("generate").main(["--load", str(saved), "--prompt", "1 2", "--max-new-tokens", "2"]) == 1
    assert _tool("plan_parallelism").main(["--model", "gpt_tiny", "--gpus", "2"]) == 1
    assert capsys.readouterr().err == ""


def test_inspect_into_a_closed_pipe(saved):
    import subprocess
    import sys
    process = subprocess.Popen([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "inspect", "--load",
                                str(saved)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()   # before the tool has written a line
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1 and err == b"", err


def test_unwritable_outputs_are_refused_in_one_line_before_any_tensor_is_read(saved, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    convert = _tool("convert_checkpoint")
    for argv in (["export-hf", "--load", str(saved), "--output"], ["export-megatron", "--load", str(saved), "--output"],
                 ["import-hf", "--input", str(tmp_path), "--save"], ["import-megatron", "--input", str(tmp_path),
                                                                     "--save"]):
        assert convert.main([*argv, str(tmp_path / "file" / "out")]) == 2
        assert capsys.readouterr().err == (f"convert_checkpoint: error: {tmp_path}/file/out: cannot be created: "
                                           f"{tmp_path}/file is not a directory\n")
    assert convert.main(["export-hf", "--load", str(saved), "--output", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == f"convert_checkpoint: error: {tmp_path}/file: exists and is not a directory\n"


class _Payload:
    """Pickled into a pytorch_model.bin: unpickling it would create a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _hf_config(directory: Path, **config) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 16, "n_positions": 8,
                                                       "n_embd": 8, "n_layer": 1, "n_head": 2, **config}))
    return directory


def _refused_import(directory: Path, capsys) -> str:
    assert _tool("convert_checkpoint").main(["import-hf", "--input", str(directory), "--save",
                                             str(directory.parent / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint: error: ") and err.count("\n") == 1, err
    return err.removeprefix("convert_checkpoint: error: ").strip()


def test_bad_hugging_face_files_are_one_line_and_never_unpickled(tmp_path, capsys):
    """Truncated or foreign weights, a pickle of objects, a config.json that is not a model's: one line naming the
    file (no traceback, no advice to load with weights_only=False, nothing unpickled)."""
    directory = _hf_config(tmp_path / "hf")
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": ")   # cut short
    assert _refused_import(directory, capsys).startswith(f"{directory}/model.safetensors: not a readable safetensors "
                                                         f"file (")
    (directory / "model.safetensors").unlink()
    torch.save({"wte": torch.zeros(3)}, directory / "pytorch_model.bin")
    (directory / "pytorch_model.bin").write_bytes((directory / "pytorch_model.bin").read_bytes()[:200])
    pickled = (f"{directory}/pytorch_model.bin: not a weights-only PyTorch state dict (truncated, or it holds objects "
               f"other than tensors, which megalite does not unpickle)")
    assert _refused_import(directory, capsys) == pickled
    torch.save({"wte": _Payload(tmp_path / "ran")}, directory / "pytorch_model.bin")
    assert _refused_import(directory, capsys) == pickled and not (tmp_path / "ran").exists()
    torch.save([torch.zeros(3)], directory / "pytorch_model.bin")
    assert _refused_import(directory, capsys) == f"{directory}/pytorch_model.bin: not a state dict (names to tensors)"
    (directory / "config.json").write_text("[1]")
    assert _refused_import(directory, capsys) == f"{directory}/config.json: not a JSON object"
    _hf_config(directory, model_type="qwen2_moe")
    assert _refused_import(directory, capsys).startswith(f"{directory}/config.json: not a qwen2_moe config: no ")
    _hf_config(directory, model_type="llama", hidden_size="8", num_attention_heads=2)
    assert _refused_import(directory, capsys).startswith(f"{directory}/config.json: not a llama config: a value of "
                                                         f"the wrong type or range")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../hf/x.safetensors"}}))
    _hf_config(directory)
    assert _refused_import(directory, capsys) == (f"{directory}/model.safetensors.index.json: shard "
                                                  f"'../hf/x.safetensors' is not a file of {directory}")
