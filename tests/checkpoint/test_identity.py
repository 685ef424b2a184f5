"""Same model or a clear refusal: resuming with any model option that changes what the model computes (a mixture's
router too), or with another tokenizer, stops with one line listing each difference with both values;
--use-checkpoint-args takes them from the checkpoint instead (the resumed losses are those of a resume with the right
options); --finetune loads the weights into another model anyway; options that only shape training or how the numbers
are computed may differ (--fp8-param-gather, grouped GEMM, the balancing loss, Megatron's --attention-backend)."""

from __future__ import annotations

import dataclasses

import pytest

import pretrain_gpt
from megalite.checkpoint import open_checkpoint
from megalite.checkpoint.identity import model_identity
from megalite.config import ModelConfig
from megalite.data.tokenizer import SentencePieceTokenizer, train_sentencepiece
from megalite.training import Trainer

from ..data.helpers import VOCAB_SIZE, generated_documents
from ..helpers import losses, read_metrics, single_layout, tiny_config, with_checkpoint
from .helpers import CPU, refused, train_and_save, write_manifest

# A Llama-style tiny model: every architecture option away from its default.
LLAMA = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
         "--vocab-size": "301", "--position-embedding-type": "rope", "--normalization": "RMSNorm", "--swiglu": None,
         "--group-query-attention": None, "--num-query-groups": "2", "--disable-bias-linear": None}
MOE = {**LLAMA, "--num-experts": "4", "--moe-ffn-hidden-size": "32", "--moe-aux-loss-coeff": "1e-2"}
RUN = ["data=mock", "--eval-interval", "0", "--train-iters", "3", "--lr", "1e-3"]


def _argv(options: dict) -> list[str]:
    return [*RUN, *[word for flag, value in options.items() for word in ([flag] if value is None else [flag, value])]]


def _changed(**changes) -> dict:
    """LLAMA with flags set (a value), switched on (None) or removed (False)."""
    options = {**LLAMA, **changes}
    return {flag: value for flag, value in options.items() if value is not False}


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A save directory with the Llama-style model after 2 of 3 iterations."""
    directory = tmp_path_factory.mktemp("llama") / "ckpt"
    assert pretrain_gpt.main([*_argv(LLAMA), "--train-iters", "3", "--exit-interval", "2", "--save",
                              str(directory)]) == 0
    return directory


@pytest.mark.parametrize("changes, difference", [
    ({"--rotary-base": "500000"}, "--rotary-base 10000 (checkpoint) vs 500000"),
    ({"--position-embedding-type": "learned_absolute"}, "--position-embedding-type rope (checkpoint) vs "
                                                        "learned_absolute"),
    ({"--normalization": "LayerNorm"}, "--normalization RMSNorm (checkpoint) vs LayerNorm"),
    ({"--swiglu": False}, "--swiglu True (checkpoint) vs False"),
    ({"--disable-bias-linear": False}, "--disable-bias-linear True (checkpoint) vs False"),
    ({"--num-query-groups": "1"}, "--num-query-groups 2 (checkpoint) vs 1"),
    ({"--group-query-attention": False, "--num-query-groups": False}, "--num-query-groups 2 (checkpoint) vs 4"),
    ({"--num-layers": "4"}, "--num-layers 2 (checkpoint) vs 4"),
    ({"--hidden-size": "128"}, "--hidden-size 64 (checkpoint) vs 128, --ffn-hidden-size 256 (checkpoint) vs 512"),
    ({"--ffn-hidden-size": "96"}, "--ffn-hidden-size 256 (checkpoint) vs 96"),
    ({"--num-attention-heads": "8"}, "--num-attention-heads 4 (checkpoint) vs 8"),
    ({"--vocab-size": "311"}, "--vocab-size 301 (checkpoint) vs 311"),
    ({"--layernorm-epsilon": "1e-6"}, "--layernorm-epsilon 1e-05 (checkpoint) vs 1e-06"),
    ({"--untie-embeddings-and-output-weights": None}, "--untie-embeddings-and-output-weights False (checkpoint) vs "
                                                       "True"),
])
def test_each_model_difference_is_refused_naming_both_values(llama_checkpoint, capsys, changes, difference):
    error = refused([*_argv(_changed(**changes)), "--load", str(llama_checkpoint)], capsys)
    assert error == (f"{llama_checkpoint}/iter_0000002: trained with another model: {difference} "
                     f"(--use-checkpoint-args takes the model from the checkpoint, --finetune loads its weights into "
                     f"this one)")


def test_every_difference_in_one_line_and_use_checkpoint_args_takes_them(llama_checkpoint, tmp_path, capsys):
    wrong = _changed(**{"--rotary-base": "500000", "--normalization": "LayerNorm", "--swiglu": False,
                        "--hidden-size": "128"})
    error = refused([*_argv(wrong), "--load", str(llama_checkpoint)], capsys)
    assert ("--hidden-size 64 (checkpoint) vs 128, --ffn-hidden-size 256 (checkpoint) vs 512, --rotary-base 10000 "
            "(checkpoint) vs 500000, --normalization RMSNorm (checkpoint) vs LayerNorm, --swiglu True (checkpoint) "
            "vs False") in error
    right, taken = tmp_path / "right.jsonl", tmp_path / "taken.jsonl"
    assert pretrain_gpt.main([*_argv(LLAMA), "--load", str(llama_checkpoint), "--metrics-file", str(right)]) == 0
    capsys.readouterr()
    assert pretrain_gpt.main([*_argv(wrong), "--load", str(llama_checkpoint), "--use-checkpoint-args",
                              "--metrics-file", str(taken)]) == 0
    out = capsys.readouterr().out
    assert (f"--use-checkpoint-args: the model options of {llama_checkpoint}/iter_0000002 (--hidden-size 64, "
            f"--rotary-base 10000, --normalization RMSNorm, --swiglu True)") in out
    assert [r["iteration"] for r in read_metrics(taken)] == [3]
    assert losses(read_metrics(taken)) == losses(read_metrics(right))   # bit for bit: the same model resumed


def test_finetune_loads_into_another_model_with_a_note(llama_checkpoint, capsys):
    assert pretrain_gpt.main([*_argv(_changed(**{"--rotary-base": "500000"})), "--load", str(llama_checkpoint),
                              "--finetune", "--train-iters", "1"]) == 0
    assert ("--finetune: this model differs from the checkpoint's: --rotary-base 10000 (checkpoint) vs 500000"
            in capsys.readouterr().out)


def test_options_that_only_shape_training_may_differ(llama_checkpoint):
    assert pretrain_gpt.main([*_argv(_changed(**{"--seq-length": "16"})), "--hidden-dropout", "0.2",
                              "--attention-dropout", "0", "--init-method-std", "0.01", "--recompute-granularity",
                              "selective", "--make-vocab-size-divisible-by", "64", "--attention-backend", "flash",
                              "--load", str(llama_checkpoint)]) == 0


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("moe") / "ckpt"
    assert pretrain_gpt.main([*_argv(MOE), "--exit-interval", "2", "--save", str(directory)]) == 0
    return directory


def test_how_a_mixture_trains_may_differ_its_routing_may_not(moe_checkpoint, capsys):
    """Grouped GEMM (the same products), the balancing loss's coefficient and token dropping say how the experts
    train; the number of experts a token goes to is the model."""
    assert pretrain_gpt.main([*_argv({**MOE, "--moe-grouped-gemm": None, "--moe-aux-loss-coeff": "0.05",
                                      "--moe-expert-capacity-factor": "1.5"}), "--load", str(moe_checkpoint)]) == 0
    capsys.readouterr()
    error = refused([*_argv({**MOE, "--moe-router-topk": "1"}), "--load", str(moe_checkpoint)], capsys)
    assert error == (f"{moe_checkpoint}/iter_0000002: trained with another model: --moe-router-topk 2 (checkpoint) "
                     f"vs 1 (--use-checkpoint-args takes the model from the checkpoint, --finetune loads its weights "
                     f"into this one)")


def test_fp8_param_gather_may_change_on_resume_bit_for_bit(tmp_path):
    """--fp8-param-gather gathers the FP8 weights the linears multiply by anyway: a resume that turns it on
    continues with the losses of one that leaves it off."""
    cfg = tiny_config(model={"fp8_format": "hybrid", "fp8_recipe": "tensorwise"}, data={"eval_interval": 0},
                      optimizer={"use_distributed_optimizer": True},
                      training={"bf16": True, "train_iters": 4, "micro_batch_size": 4, "global_batch_size": 4})
    train_and_save(cfg, tmp_path, 2)
    runs = []
    for gather in (False, True):
        resumed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8_param_gather=gather))
        with single_layout():
            runs.append(losses(Trainer.on_registered_layout(with_checkpoint(resumed, load=str(tmp_path)), CPU).train()))
    assert len(runs[0]) == 2 and runs[1] == runs[0]


def test_identity_resolves_defaults():
    base = ModelConfig(hidden_size=64, num_attention_heads=4)
    same = [dataclasses.replace(base, ffn_hidden_size=256), dataclasses.replace(base, group_query_attention=True,
                                                                                 num_query_groups=4),
            dataclasses.replace(base, max_position_embeddings=base.seq_length), dataclasses.replace(base,
                                                                                                  rotary_base=7)]
    assert all(model_identity(other) == model_identity(base) for other in same)
    rope = dataclasses.replace(base, position_embedding_type="rope")
    assert model_identity(dataclasses.replace(rope, max_position_embeddings=4096)) == model_identity(rope)
    assert model_identity(dataclasses.replace(rope, rotary_base=7)) != model_identity(rope)


@pytest.fixture(scope="module")
def corpus_checkpoint(corpus, tmp_path_factory):
    """A checkpoint trained on the generated corpus, and another tokenizer of the same vocabulary size."""
    directory = tmp_path_factory.mktemp("corpus_ckpt")
    other = train_sentencepiece(generated_documents(400, seed=1), directory / "other", VOCAB_SIZE)
    assert SentencePieceTokenizer(other).vocab_size == corpus.tokenizer.vocab_size
    data = ["--data-path", str(corpus.prefix), "model=gpt_tiny", "--eval-interval", "0", "--train-iters", "3"]
    assert pretrain_gpt.main([*data, "--tokenizer-model", str(corpus.tokenizer_model), "--exit-interval", "2",
                              "--save", str(directory / "ckpt")]) == 0
    return directory / "ckpt", data, other


def test_another_tokenizer_is_refused_and_use_checkpoint_args_takes_the_saved_one(corpus, corpus_checkpoint, capsys):
    ckpt, data, other = corpus_checkpoint
    checkpoint = open_checkpoint(ckpt)
    saved = checkpoint.manifest.tokenizer
    assert saved["files"] == ["tokenizer.model"] and saved["file"] == "tokenizer.model"
    assert saved["fingerprint"] == corpus.tokenizer.fingerprint() != SentencePieceTokenizer(other).fingerprint()
    error = refused([*data, "--tokenizer-model", str(other), "--load", str(ckpt)], capsys)
    assert (f"trained with another model: tokenizer SentencePieceTokenizer {saved['fingerprint'][:12]} (checkpoint) "
            f"vs SentencePieceTokenizer {SentencePieceTokenizer(other).fingerprint()[:12]}") in error
    assert pretrain_gpt.main([*data, "--tokenizer-model", str(other), "--load", str(ckpt),
                              "--use-checkpoint-args"]) == 0
    assert (f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {checkpoint.path}/tokenizer.model"
            in capsys.readouterr().out)
    # A checkpoint from before fingerprints were recorded: the stored tokenizer is rebuilt to compare it.
    write_manifest(checkpoint.path, dataclasses.replace(
        checkpoint.manifest, digests=None, tokenizer={"type": saved["type"], "file": saved["file"],
                                                      "eod": saved["eod"]}))
    assert "tokenizer SentencePieceTokenizer" in refused([*data, "--tokenizer-model", str(other), "--load",
                                                           str(ckpt)], capsys)
