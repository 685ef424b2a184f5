"""Megatron command lines: every unknown flag at once with its nearest spelling, the flags accepted without effect
(listed, in --help too, and stored nowhere), values megalite cannot honour refused by name, --sequence-parallel at
TP=1 turned off, and Megatron's rules for iteration- against sample-based options."""

from __future__ import annotations

import pytest

from megalite.config import ConfigError, megatron, to_dict, validate
from megalite.config.cli import build_parser, parse_args, parse_command_line

from ..helpers import tiny_config


def test_unknown_flags_are_listed_at_once_with_the_nearest_spelling():
    with pytest.raises(ConfigError) as error:
        parse_args(["--num-layer", "2", "--lr", "1e-3", "--mtp-num-layer", "2", "--tensor-model-paralel-size", "2",
                    "--sequence-paralel", "--moe-latent-size", "4"])
    message = str(error.value)
    assert message == ("unknown flags --num-layer (did you mean --num-layers?), --mtp-num-layer (did you mean "
                       "--mtp-num-layers?), "
                       "--tensor-model-paralel-size (did you mean --tensor-model-parallel-size?), --sequence-paralel "
                       "(did you mean --sequence-parallel?), --moe-latent-size (see --help)")


def test_accepted_flags_parse_and_are_listed_as_without_effect():
    command_line = parse_command_line([
        "--use-mcore-models", "--attention-backend", "fused", "--cross-entropy-loss-fusion", "--manual-gc",
        "--empty-unused-memory-level", "1", "--log-throughput", "--ckpt-format", "torch_dist", "--no-mmap-bin-files",
        "--no-create-attention-mask-in-dataloader", "--num-workers", "1", "--calculate-per-token-loss",
        "--use-pytorch-profiler", "--tiktoken-pattern", "v2", "--tokenizer-type", "NullTokenizer",
        "--position-embedding-type", "rope", "--no-position-embedding", "data=mock"])
    cfg = command_line.config
    validate(cfg, 1)
    assert megatron.without_effect(cfg, command_line.accepted) == [
        "--attention-backend fused", "--num-workers 1", "--no-mmap-bin-files",
        "--no-create-attention-mask-in-dataloader", "--calculate-per-token-loss", "--use-mcore-models", "--log-throughput",
        "--use-pytorch-profiler", "--ckpt-format torch_dist", "--cross-entropy-loss-fusion",
        "--tiktoken-pattern v2 (the tokenizer is NullTokenizer)", "--no-position-embedding (positions are rope)"]
    # --manual-gc and --empty-unused-memory-level do something here.
    line, = megatron.start_lines(cfg, command_line.accepted)
    assert line.startswith("megalite: accepted without effect here") and "--manual-gc" not in line
    assert megatron.start_lines(tiny_config()) == []
    # Stored nowhere: the config (and so a checkpoint's manifest) is the one without them.
    saved = to_dict(cfg)
    assert not any(key.split(".")[1] in saved[key.split(".")[0]] for key in megatron.SAVED_BEFORE)
    assert cfg == parse_args(["--manual-gc", "--empty-unused-memory-level", "1", "--tiktoken-pattern", "v2",
                              "--tokenizer-type", "NullTokenizer", "--position-embedding-type", "rope",
                              "--no-position-embedding", "data=mock"])
    help_text = build_parser().format_help()
    for accepted in megatron.ACCEPTED:
        assert accepted.flag in help_text
    assert "--attention-backend auto|flash|fused|unfused|local" in help_text


@pytest.mark.parametrize("argv, message", [
    (["--ckpt-format", "torch"], "argument --ckpt-format: invalid choice: 'torch'"),
    (["--attention-backend", "cudnn"], "argument --attention-backend: invalid choice: 'cudnn'"),
    (["--num-workers", "two"], "argument --num-workers: invalid int value: 'two'"),
    (["--num-workers"], "argument --num-workers: expected one argument"),
    (["--cross-entropy-loss-fusion", "--no-cross-entropy-loss-fusion"],
     "--cross-entropy-loss-fusion and --no-cross-entropy-loss-fusion exclude each other"),
    (["--use-mcore-model"], "unknown flag --use-mcore-model (did you mean --use-mcore-models?)"),
    (["model.attention_backend=auto"], "Key 'attention_backend' not in 'ModelConfig'"),   # no Hydra key
])
def test_accepted_flags_refuse_what_megalite_cannot_honour(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_command_line(argv)
    assert message in str(error.value)


def test_no_position_embedding_with_learned_positions_is_no_positions():
    cfg = tiny_config(model={"no_position_embedding": True})
    assert not cfg.model.learned_positions and megatron.without_effect(cfg) == []


@pytest.mark.parametrize("cfg, message", [
    (tiny_config(optimizer={"grad_reduce_in_bf16": True}), "--grad-reduce-in-bf16 needs --bf16"),
    (tiny_config(optimizer={"decoupled_min_lr": 1e-4}), "--decoupled-min-lr needs --decoupled-lr"),
    (tiny_config(optimizer={"decoupled_lr": 1e-5}), "need 0 <= --decoupled-min-lr <= --decoupled-lr, got 1e-05 and "
                                                   "0.0001 (the default, --min-lr)"),
    (tiny_config(model={"rotary_percent": 0.2, "position_embedding_type": "rope"}),
     "an even number of rotated channels, got head dimension 16 x --rotary-percent 0.2 = 3"),
    (tiny_config(model={"rotary_percent": 1.5}), "--rotary-percent must be in (0, 1]"),
    (tiny_config(model={"hidden_size": 66}), "(or give the head dimension: --kv-channels)"),
    (tiny_config(training={"train_samples": 80}), "give one of --train-iters and --train-samples"),
    (tiny_config(training={"train_iters": None, "train_samples": 80}),
     "with --train-samples the schedule is in samples: --lr-warmup-iters becomes --lr-warmup-samples"),
    (tiny_config(optimizer={"lr_warmup_iters": 0, "lr_decay_samples": 10}),
     "--lr-decay-samples is for sample-based training"),
    (tiny_config(optimizer={"lr_warmup_fraction": 0.1}), "give one of --lr-warmup-fraction and --lr-warmup-iters"),
    (tiny_config(training={"rampup_batch_size": "2 2 100", "global_batch_size": 8}, parallel={}), None),
    (tiny_config(training={"rampup_batch_size": "2 2 100"}), "reaches global batch 2, which is not divisible by "
                                                             "--micro-batch-size 2 x data-parallel size 2 = 4"),
    (tiny_config(training={"step_batch_size_schedule": "0:4 64:16"}), "the largest batch of "
                                                                      "--step-batch-size-schedule is 16"),
    (tiny_config(data={"tokenizer_type": "TikTokenizer", "mock_data": False, "data_path": "x",
                       "tokenizer_model": "t.json"}), "TikTokenizer needs --tiktoken-pattern v1 or v2"),
    (tiny_config(data={"tokenizer_type": "Llama2Tokenizer", "mock_data": False, "data_path": "x"}),
     "--tokenizer-type Llama2Tokenizer needs --tokenizer-model"),
    (tiny_config(logging={"profile": True, "profile_step_start": 4, "profile_step_end": 4}),
     "--profile-step-end 4 must be greater than --profile-step-start 4"),
    (tiny_config(logging={"profile_ranks": "0 2"}), "--profile-ranks '0 2' must be ranks in [0, 2)"),
    (tiny_config(logging={"wandb_exp_name": "x"}), "--wandb-exp-name needs --wandb-project"),
    (tiny_config(training={"empty_unused_memory_level": 3}), "--empty-unused-memory-level must be 0, 1 or 2"),
])
def test_refusals_name_the_option(cfg, message):
    if message is None:   # a ramp whose every size fits the layout
        validate(cfg, 1)
        return
    with pytest.raises(ConfigError) as error:
        validate(cfg, 2)
    assert message in str(error.value)


def test_sequence_parallel_at_tp_1_is_turned_off_with_one_warning():
    cfg, warnings = megatron.adjust(tiny_config(parallel={"sequence_parallel": True}))
    assert not cfg.parallel.sequence_parallel and len(warnings) == 1
    assert warnings[0] == ("megalite: warning: --sequence-parallel turned off: it needs --tensor-model-parallel-size "
                           "> 1 (Megatron turns it off too)")
    kept, none = megatron.adjust(tiny_config(tp=2, parallel={"sequence_parallel": True}))
    assert kept.parallel.sequence_parallel and none == []
