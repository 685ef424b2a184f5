"""megalite.config.deepspeed: a DeepSpeed JSON config read as megalite options, through megalite.config.cli as users
run it.

Each test writes a small JSON file and parses a command line naming it (``--deepspeed-config``); the world size is
passed explicitly, as pretrain_gpt.py does, because the batch arithmetic needs the data-parallel size.
"""

from __future__ import annotations

import json
import math

import pytest

from megalite.config import flags
from megalite.config.cli import parse_args, parse_command_line
from megalite.config import ConfigError, MegaliteConfig, validate
from megalite.config.deepspeed import translate
from megalite.optimizer.lr_schedule import learning_rate

ZERO3_OFFLOAD = {"train_batch_size": 32, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}


@pytest.fixture
def ds(tmp_path):
    """ds(config_dict, *argv, world_size=1) -> CommandLine for ``--deepspeed-config <file> *argv``."""
    def parse(config, *argv, world_size=1):
        path = tmp_path / "ds.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        return parse_command_line(["--deepspeed-config", str(path), *argv], world_size=world_size)
    return parse


def error_of(ds, config, *argv, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        ds(config, *argv, world_size=world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- the example and ZeRO stages --------------------------------------------------------------------------

def test_zero3_offload_example_parses_and_validates(ds):
    command_line = ds(ZERO3_OFFLOAD, world_size=4)
    cfg = command_line.config
    o, t = cfg.optimizer, cfg.training
    assert (o.zero_stage, o.use_distributed_optimizer, o.optimizer_cpu_offload, o.offload_params) == (3, False, True,
                                                                                                      True)
    assert (t.global_batch_size, t.micro_batch_size) == (32, 8)   # DeepSpeed: GA 1, micro = 32 / DP 4
    validate(cfg, 4)
    lines = command_line.deepspeed_settings()
    assert any(line.endswith("zero_optimization.stage 3 -> --zero-stage 3") for line in lines), lines
    assert all(line.startswith("deepspeed config ") for line in lines)


@pytest.mark.parametrize("stage, distributed, zero_stage", [(0, False, 1), (1, True, 1), (2, True, 2), (3, False, 3)])
def test_zero_stages(ds, stage, distributed, zero_stage):
    o = ds({"zero_optimization": {"stage": stage}}, world_size=2).config.optimizer
    assert (o.use_distributed_optimizer, o.zero_stage) == (distributed, zero_stage)


def test_stage_0_undoes_a_distributed_optimizer_from_yaml_but_not_a_flag(ds, tmp_path, monkeypatch):
    assert ds({"zero_optimization": {}}, "optimizer.zero_stage=2").config.optimizer.zero_stage == 2  # override wins
    o = ds({"zero_optimization": {}}).config.optimizer   # a block without "stage": DeepSpeed's default, 0
    assert (o.use_distributed_optimizer, o.zero_stage) == (False, 1)
    o = ds({"zero_optimization": {"stage": 0}}, "--use-distributed-optimizer").config.optimizer
    assert o.use_distributed_optimizer   # the flag beside the file wins


def test_offload_devices(ds):
    o = ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True}}},
           "--optimizer-cpu-offload").config.optimizer
    assert o.optimizer_cpu_offload   # the flag wins over "none"
    o = ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}).config
    assert o.optimizer.optimizer_cpu_offload and not o.optimizer.offload_params
    message = error_of(ds, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                                  "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})
    assert "zero_optimization.offload_optimizer.device=nvme" in message
    assert "zero_optimization.offload_param.device=nvme" in message
    assert "zero_optimization.offload_param.nvme_path=/local_nvme" in message
    assert "cpu, nvme or none" in error_of(ds, {"zero_optimization": {"offload_param": {"device": "gpu"}}})


def test_offload_params_needs_stage_3_from_validate(ds):
    cfg = ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}}}).config
    with pytest.raises(ConfigError, match="--offload-params needs --zero-stage 3"):
        validate(cfg, 1)


def test_zero_communication_keys(ds):
    o = ds({"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7,
                                  "allgather_bucket_size": 5e7, "contiguous_gradients": True,
                                  "reduce_scatter": True, "allgather_partitions": True}}).config.optimizer
    assert (o.overlap_grad_reduce, o.ddp_bucket_size) == (True, 50_000_000) and type(o.ddp_bucket_size) is int
    # stage 3: FSDP2 always overlaps (accepted, nothing set: validate refuses overlap_grad_reduce at stage 3)
    cfg = ds({"zero_optimization": {"stage": 3, "overlap_comm": True}}, world_size=2).config
    assert not cfg.optimizer.overlap_grad_reduce
    validate(cfg, 2)
    message = error_of(ds, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e8,
                                                  "contiguous_gradients": False}})
    assert "zero_optimization.allgather_bucket_size=200000000" in message
    assert "zero_optimization.contiguous_gradients=false" in message
    message = error_of(ds, {"zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 5e7}})
    assert "zero_optimization.overlap_comm=false" in message
    assert "zero_optimization.reduce_bucket_size=50000000" in message


# --- precision ----------------------------------------------------------------------------------------------------

def test_bf16(ds):
    assert ds({"bf16": {"enabled": True}}).config.training.bf16
    assert ds({"bfloat16": {"enabled": True}}).config.training.bf16   # DeepSpeed's other spelling
    assert not ds({"bf16": {"enabled": False}}, "training.fp16=true").config.training.bf16


def test_fp16_dynamic_scaler(ds):
    o = ds({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                     "hysteresis": 3, "min_loss_scale": 0.5}}).config.optimizer
    assert (o.loss_scale, o.initial_loss_scale, o.loss_scale_window, o.hysteresis, o.min_loss_scale) == \
        (None, 4096.0, 500, 3, 0.5)
    cfg = ds({"fp16": {"enabled": True}}).config   # DeepSpeed's defaults: 2**16, not megalite's 2**32
    assert cfg.training.fp16 and cfg.optimizer.initial_loss_scale == 2.0 ** 16 and cfg.optimizer.loss_scale is None


def test_fp16_constant_scale_and_refusals(ds):
    cfg = ds({"fp16": {"enabled": True, "loss_scale": 128}}).config
    assert cfg.optimizer.loss_scale == 128.0
    validate(cfg, 1)
    message = error_of(ds, {"fp16": {"enabled": True, "consecutive_hysteresis": True, "auto_cast": True}})
    assert "fp16.consecutive_hysteresis=true" in message and "fp16.auto_cast=true" in message
    cfg = ds({"fp16": {"enabled": False, "loss_scale": 128, "consecutive_hysteresis": True}}).config
    assert not cfg.training.fp16 and cfg.optimizer.loss_scale is None   # inactive, as in DeepSpeed
    validate(cfg, 1)


# --- optimizer and schedule ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["Adam", "AdamW", "adamw", "ADAM"])
def test_adam_params(ds, kind):
    o = ds({"optimizer": {"type": kind, "params": {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                   "weight_decay": 0.1, "torch_adam": True}}}).config.optimizer
    assert (o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == (2e-4, 0.8, 0.95, 1e-6, 0.1)


def test_adam_omitted_params_take_deepspeed_defaults(ds):
    o = ds({"optimizer": {"type": "AdamW"}}).config.optimizer
    assert (o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == (1e-3, 0.9, 0.999, 1e-8, 0.0)


def test_adam_without_decoupled_decay_and_other_optimizers_are_refused(ds):
    message = error_of(ds, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert "optimizer.params.adam_w_mode=false" in message
    assert ds({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}).config   # AdamW stays AdamW
    assert "optimizer.type=Lamb" in error_of(ds, {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    assert "optimizer.params.amsgrad=true" in error_of(ds, {"optimizer": {"type": "AdamW",
                                                                          "params": {"amsgrad": True}}})


def deepspeed_lr(kind: str, params: dict, lr: float, step: int) -> float:
    """DeepSpeed's schedules (runtime/lr_schedules.py) with linear warm-up, at its step counter ``step``."""
    warmup = max(2, params["warmup_num_steps"])
    if kind == "WarmupCosineLR":
        if step < warmup:
            return lr * step / warmup
        progress = (step - warmup + 1) / (params["total_num_steps"] - warmup)
        floor = params["cos_min_ratio"]
        return lr * max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    peak = params["warmup_max_lr"]
    if step < warmup:
        return peak * step / warmup
    if kind == "WarmupLR":
        return peak
    return peak * max(0.0, (params["total_num_steps"] - step) / max(1.0, params["total_num_steps"] - warmup))


def test_warmup_lr(ds):
    params = {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 5, "warmup_type": "linear"}
    o = ds({"scheduler": {"type": "WarmupLR", "params": params}}).config.optimizer
    assert (o.lr, o.lr_warmup_iters, o.lr_decay_style) == (3e-3, 5, "constant")
    assert [learning_rate(k, o, 20) for k in range(1, 21)] == \
        pytest.approx([deepspeed_lr("WarmupLR", params, 0, k) for k in range(1, 21)])


def test_warmup_decay_lr_follows_deepspeed_step_for_step(ds):
    params = {"warmup_max_lr": 1e-3, "warmup_num_steps": 4, "total_num_steps": 30, "warmup_type": "linear"}
    cfg = ds({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}, "scheduler": {
        "type": "WarmupDecayLR", "params": params}}, "--train-iters", "40").config
    o = cfg.optimizer
    assert (o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters, o.lr_decay_style) == (1e-3, 0.0, 4, 30, "linear")
    # megalite's iteration k has DeepSpeed's value at its step counter k, through the warm-up and the decay
    assert [learning_rate(k, o, 40) for k in range(1, 41)] == \
        pytest.approx([deepspeed_lr("WarmupDecayLR", params, 0, k) for k in range(1, 41)])


def test_warmup_cosine_lr(ds):
    params = {"warmup_num_steps": 5, "total_num_steps": 50, "cos_min_ratio": 0.1, "warmup_type": "linear"}
    o = ds({"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
            "scheduler": {"type": "WarmupCosineLR", "params": params}}).config.optimizer
    assert (o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters, o.lr_decay_style) == \
        (2e-3, pytest.approx(2e-4), 5, 50, "cosine")
    # The warm-up matches step for step; DeepSpeed's cosine starts at its last warm-up step, so the peak lr (held at
    # megalite's iteration 5) is where DeepSpeed already decays: after it, megalite is one step behind.
    assert [learning_rate(k, o, 60) for k in range(1, 5)] == \
        pytest.approx([deepspeed_lr("WarmupCosineLR", params, 2e-3, k) for k in range(1, 5)])
    assert learning_rate(5, o, 60) == 2e-3
    assert [learning_rate(k, o, 60) for k in range(6, 51)] == \
        pytest.approx([deepspeed_lr("WarmupCosineLR", params, 2e-3, k - 1) for k in range(6, 51)])
    assert learning_rate(55, o, 60) == pytest.approx(2e-4)   # past total_num_steps: min lr (DeepSpeed's rises again)
    # the floor is a ratio of the lr the run has: a --lr beside the file moves it too
    o = ds({"scheduler": {"type": "WarmupCosineLR", "params": params}}, "--lr", "1e-2").config.optimizer
    assert (o.lr, o.min_lr) == (1e-2, pytest.approx(1e-3))


def test_warmup_num_steps_floor(ds):
    params = {"warmup_max_lr": 1e-3, "warmup_num_steps": 0, "warmup_type": "linear"}
    assert ds({"scheduler": {"type": "WarmupLR", "params": params}}).config.optimizer.lr_warmup_iters == 2


def test_schedules_megalite_cannot_reproduce_are_refused(ds):
    message = error_of(ds, {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5,
                                                                         "warmup_max_lr": 1e-3}}})
    assert "scheduler.params.warmup_min_lr=1e-05" in message
    assert "scheduler.params.warmup_type=log (not given: DeepSpeed's default is log" in message
    assert "scheduler.params.warmup_type=log" in error_of(ds, {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_type": "log", "total_num_steps": 10}}})
    assert "scheduler.params.warmup_min_ratio=0.1" in error_of(ds, {"scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_type": "linear", "total_num_steps": 10, "warmup_min_ratio": 0.1}}})
    assert "scheduler.type=OneCycle" in error_of(ds, {"scheduler": {"type": "OneCycle", "params": {}}})
    assert "total_num_steps" in error_of(ds, {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_type": "linear"}}})


# --- batch sizes --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keys, global_batch, micro_batch", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 32, 2),        # GA 4
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 32, 4),           # micro 32 / 4 / 2
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 24, 2),   # 2 x 3 x 4
    ({"train_batch_size": 32}, 32, 8),                                             # GA 1
    ({"train_micro_batch_size_per_gpu": 3}, 12, 3),                                # GA 1
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 32, 4),
])
def test_any_two_batch_keys_give_the_third(ds, keys, global_batch, micro_batch):
    # world size 8 at TP 2: data-parallel size 4
    cfg = ds(keys, "--tensor-model-parallel-size", "2", world_size=8).config
    assert (cfg.training.global_batch_size, cfg.training.micro_batch_size) == (global_batch, micro_batch)
    validate(cfg, 8)


def test_inconsistent_batch_triple_shows_the_arithmetic(ds):
    message = error_of(ds, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                            "gradient_accumulation_steps": 4}, world_size=2)
    assert "train_batch_size 32 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x " \
           "data-parallel size 2 = 16" in message
    assert str(message).startswith("--deepspeed-config ") and "ds.json" in message
    message = error_of(ds, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3}, world_size=2)
    assert "gradient_accumulation_steps 5 (derived) x data-parallel size 2 = 30" in message
    assert "alone" in error_of(ds, {"gradient_accumulation_steps": 4})
    assert "must be >= 1" in error_of(ds, {"train_batch_size": 0})


def test_batch_sizes_on_the_command_line_win_and_enter_the_arithmetic(ds):
    # --micro-batch-size replaces the file's; the file's accumulation gives way; the global batch stays 32
    command_line = ds({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1},
                      "--micro-batch-size", "2", world_size=4)
    t = command_line.config.training
    assert (t.global_batch_size, t.micro_batch_size) == (32, 2)
    validate(command_line.config, 4)
    lines = command_line.deepspeed_settings()
    assert any("train_micro_batch_size_per_gpu 8 -> --micro-batch-size 8; overridden by the command line: "
               "--micro-batch-size 2" in line for line in lines), lines
    assert any("gradient_accumulation_steps 4" in line for line in lines), lines
    # the Hydra key counts as the command line too; what the file leaves open follows from the user's value
    t = ds({"train_micro_batch_size_per_gpu": 4}, "training.micro_batch_size=1", world_size=4).config.training
    assert (t.global_batch_size, t.micro_batch_size) == (4, 1)
    t = ds({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, "--global-batch-size", "64",
           world_size=4).config.training
    assert (t.global_batch_size, t.micro_batch_size) == (64, 2)


def test_world_size_defaults_to_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32}))
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_args(["--deepspeed-config", str(path)]).training.micro_batch_size == 8
    monkeypatch.delenv("WORLD_SIZE")
    assert parse_args(["--deepspeed-config", str(path)]).training.micro_batch_size == 32


# --- the other keys, refusals, auto, precedence, errors ----------------------------------------------------------

def test_logging_and_clipping_keys(ds):
    cfg = ds({"steps_per_print": 5, "wall_clock_breakdown": True, "gradient_clipping": 0.5}).config
    assert (cfg.logging.log_interval, cfg.logging.timing_log_level, cfg.optimizer.clip_grad) == (5, 1, 0.5)
    lines = ds({"train_batch_size": 8}).deepspeed_settings()
    assert any("gradient_clipping not given" in line for line in lines)


def test_unsupported_keys_are_refused_by_name_in_one_error(ds):
    message = error_of(ds, {"train_batch_size": 8, "aio": {"block_size": 1048576},
                            "activation_checkpointing": {"partition_activations": True},
                            "comms_logger": {"enabled": True},
                            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7}})
    for name in ("aio", "activation_checkpointing", "comms_logger", "zero_optimization.stage3_prefetch_bucket_size"):
        assert name in message
    assert message.count("megalite cannot honour") == 1


def test_auto_keeps_megalite_values_and_disabled_blocks_are_accepted(ds):
    command_line = ds({"train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                       "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
                       "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
                       "tensorboard": {"enabled": False, "output_path": "runs"}},
                      "--global-batch-size", "16", "--lr", "0.02", "--bf16")
    cfg = command_line.config
    assert (cfg.training.global_batch_size, cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.training.bf16) == \
        (16, 0.02, MegaliteConfig().optimizer.weight_decay, True)
    assert cfg.optimizer.clip_grad == MegaliteConfig().optimizer.clip_grad
    text = "\n".join(command_line.deepspeed_settings())
    assert "auto, so megalite's own value is kept: " in text and "zero_optimization.stage3_prefetch_bucket_size" in text
    assert "tensorboard disabled" in text


def test_precedence_yaml_then_file_then_overrides_then_flags(ds, tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "config.yaml").write_text("defaults:\n  - megalite_schema\n  - _self_\n"
                                         "optimizer:\n  lr: 7.0\n  weight_decay: 0.3\n  adam_eps: 0.125\n")
    monkeypatch.setenv(flags.CONFIG_DIR_ENV, str(configs))
    optimizer = {"type": "AdamW", "params": {"lr": 0.5, "weight_decay": 0.2, "eps": 0.25}}
    o = ds({"optimizer": optimizer}).config.optimizer
    assert (o.lr, o.weight_decay, o.adam_eps) == (0.5, 0.2, 0.25)     # the file beats the YAML
    command_line = ds({"optimizer": optimizer}, "--lr", "2", "optimizer.weight_decay=0.05")
    o = command_line.config.optimizer
    assert (o.lr, o.weight_decay, o.adam_eps) == (2.0, 0.05, 0.25)    # the command line beats the file
    o = ds({"optimizer": optimizer}, "optimizer.lr=3", "--lr", "4").config.optimizer
    assert o.lr == 4.0                                                # and a flag beats an override
    lines = command_line.deepspeed_settings()
    assert any(line.endswith("optimizer.params.lr 0.5 -> --lr 0.5; overridden by the command line: --lr 2.0")
               for line in lines), lines


@pytest.mark.parametrize("text, fragment", [
    ('{"train_batch_size": 32,}', "not valid JSON"),
    ('{"train_batch_size": 32', "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"train_batch_size": "32"}', "train_batch_size must be an integer, got 32"),
    ('{"train_batch_size": 8.5}', "train_batch_size must be an integer"),
    ('{"gradient_clipping": true}', "gradient_clipping must be a number"),
    ('{"zero_optimization": 3}', "zero_optimization must be a JSON object"),
    ('{"bf16": {"enabled": "yes"}}', "bf16.enabled must be true or false"),
    ('{"gradient_clipping": NaN}', "NaN"),
    ('{"gradient_clipping": 1e400}', "gradient_clipping must be a number"),
    ('{"train_batch_size": 8, "train_batch_size": 16}', "appears twice"),
])
def test_bad_files_are_one_line_errors_naming_the_file(ds, text, fragment):
    message = error_of(ds, text)
    assert fragment in message and "ds.json" in message


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_args(["--deepspeed-config", str(tmp_path / "nope.json")])
    assert "nope.json" in str(info.value) and "cannot read" in str(info.value) and "\n" not in str(info.value)


def test_translate_returns_hydra_overrides(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_type": "linear", "warmup_max_lr": 1e-3, "warmup_num_steps": 10}}}))
    translation = translate(str(path), 1, MegaliteConfig())
    assert translation.overrides() == ["training.bf16=true", "optimizer.lr_warmup_iters=10", "optimizer.lr=0.001",
                                       "optimizer.lr_decay_style='constant'"]
