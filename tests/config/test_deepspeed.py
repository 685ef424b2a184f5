"""megalite.config.deepspeed: a DeepSpeed JSON config read as megalite options, key by key, through
megalite.config.cli as users run it.

Each test writes a small JSON file (or takes one of the configs in the shapes people use, tests/config/
deepspeed_configs/) and parses a command line naming it (``--deepspeed-config``); the world size is passed explicitly,
as pretrain_gpt.py does, because the batch arithmetic needs the data-parallel size. That those configs train at
DP=2, and that their speed-only knobs leave the losses alone, is tests/multiprocess/test_deepspeed_configs.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megalite.config import flags
from megalite.config.cli import parse_args, parse_command_line
from megalite.config import ConfigError, MegaliteConfig, validate
from megalite.config.dims import ParallelDims
from megalite.config.deepspeed import IGNORED, MAPPED, REFUSED, RefusedKeys, translate
from megalite.optimizer.lr_schedule import learning_rate

CONFIGS = Path(__file__).resolve().parent / "deepspeed_configs"
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


def rows(command_line) -> dict[str, tuple[str, str]]:
    """The table's rows: key -> (status, the rest of the line after the status)."""
    found = {}
    for line in command_line.deepspeed_settings()[1:]:
        if line.startswith("  "):
            key, _, rest = line.strip().partition(" ")
            for status in (MAPPED, IGNORED, REFUSED):
                if f"  {status}  " in rest:
                    found[key] = (status, rest.split(f"  {status}  ", 1)[1].strip())
    return found


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
    assert lines[0].startswith("deepspeed config ") and "4 keys: 4 mapped, 0 ignored, 0 refused" in lines[0]
    table = rows(command_line)
    assert table["zero_optimization.stage"] == (MAPPED, "--zero-stage 3")
    assert table["zero_optimization.offload_param.device"] == (MAPPED, "--offload-params")
    assert table["train_micro_batch_size_per_gpu"][1] == "--micro-batch-size 8 (derived by DeepSpeed's rule at " \
                                                        "data-parallel size 4)"


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
    assert "zero_optimization.offload_optimizer.device=nvme (NVMe offload)" in message
    assert "zero_optimization.offload_param.device=nvme (NVMe offload)" in message
    assert "nvme_path" not in message   # NVMe tuning is ignored: the device names what cannot be provided
    assert "cpu, nvme or none" in error_of(ds, {"zero_optimization": {"offload_param": {"device": "gpu"}}})
    o = ds({"zero_optimization": {"stage": 3, "offload_optimizer": None, "offload_param": {"ratio": 1}}},
           world_size=2).config.optimizer   # null and an offload block without a device: nothing offloaded
    assert not o.optimizer_cpu_offload and not o.offload_params


def test_offload_params_needs_stage_3_from_validate(ds):
    cfg = ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}}}).config
    with pytest.raises(ConfigError, match="--offload-params needs --zero-stage 3"):
        validate(cfg, 1)


def test_zero_communication_keys(ds):
    command_line = ds({"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7,
                                             "allgather_bucket_size": 2e8, "contiguous_gradients": False,
                                             "reduce_scatter": False, "allgather_partitions": False,
                                             "round_robin_gradients": True}})
    o = command_line.config.optimizer
    assert (o.overlap_grad_reduce, o.ddp_bucket_size) == (True, 50_000_000) and type(o.ddp_bucket_size) is int
    table = rows(command_line)
    for key in ("allgather_bucket_size", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                "round_robin_gradients"):   # speed and memory only: accepted, with why
        assert table[f"zero_optimization.{key}"][0] == IGNORED, key
    assert "gradient buckets" in table["zero_optimization.allgather_bucket_size"][1]
    # stage 3: FSDP2 overlaps and reduces layer by layer whatever these say (validate refuses overlap_grad_reduce)
    command_line = ds({"zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 5e7,
                                             "stage3_prefetch_bucket_size": 2e5}}, world_size=2)
    cfg = command_line.config
    assert not cfg.optimizer.overlap_grad_reduce and cfg.optimizer.ddp_bucket_size is None
    assert cfg.optimizer.zero3_prefetch_bucket_size == 200_000
    validate(cfg, 2)
    table = rows(command_line)
    assert table["zero_optimization.overlap_comm"][0] == table["zero_optimization.reduce_bucket_size"][0] == IGNORED
    assert table["zero_optimization.stage3_prefetch_bucket_size"] == (MAPPED, "--zero3-prefetch-bucket-size 200000")
    # the stage the run will have decides: a --zero-stage 3 beside a stage-2 file makes overlap_comm FSDP2's
    cfg = ds({"zero_optimization": {"stage": 2, "overlap_comm": True}}, "--zero-stage", "3",
             "optimizer.use_distributed_optimizer=false", world_size=2).config
    assert cfg.optimizer.zero_level == 3 and not cfg.optimizer.overlap_grad_reduce
    validate(cfg, 2)
    below = rows(ds({"zero_optimization": {"stage": 1, "stage3_prefetch_bucket_size": 5e8}}))
    assert below["zero_optimization.stage3_prefetch_bucket_size"] == (IGNORED, "not used below stage 3 (in DeepSpeed "
                                                                               "too)")


# DeepSpeed's documented zero_optimization keys (docs/_pages/config-json.md), each with its default or a value
# people write, and what megalite does with each at stage 3 and at stage 2.
DOCUMENTED_ZERO_KEYS = {
    "stage": None, "allgather_partitions": True, "allgather_bucket_size": 5e8, "compute_grad_norm": True,
    "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True,
    "load_from_fp32_weights": True, "round_robin_gradients": False, "parameter_alignment": False,
    "offload_param": {"device": "cpu", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                      "buffer_size": 1e8, "max_in_cpu": 1e9},
    "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme", "pin_memory": True, "ratio": 1.0,
                          "buffer_count": 4, "fast_init": False},
    "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 5e8,
    "stage3_param_persistence_threshold": 1e6, "sub_group_size": 1e9, "elastic_checkpoint": False,
    "stage3_gather_16bit_weights_on_model_save": True, "stage3_module_granularity_threshold": 0,
    "ignore_unused_parameters": True, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_gradients": False, "log_trace_cache_warnings": False,
}
# ... and those only DeepSpeed's code reads (deepspeed/runtime/zero/config.py, offload_config.py), or its field names
CODE_ONLY_ZERO_KEYS = {
    "use_multi_rank_bucket_allreduce": True, "stage3_model_persistence_threshold": 1e9,
    "stage3_use_all_reduce_for_fetch_params": False, "stage3_allgather_sequential": False,
    "stage3_partition_stream_chunk_size": 0, "legacy_stage1": False, "zero_quantized_nontrainable_weights": False,
    "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}, "mics_shard_size": -1,
    "mics_hierarchical_params_gather": False, "memory_efficient_linear": True, "pipeline_loading_checkpoint": False,
    "override_module_apply": True, "enable_sanity_checks": False, "save_muon_momentum_buffer_in_memory": False,
    "leaf_module": {}, "max_live_parameters": 1e9, "max_reuse_distance": 1e9, "param_persistence_threshold": 1e5,
    "model_persistence_threshold": 1e9, "module_granularity_threshold": 0, "use_all_reduce_for_fetch_params": False,
    "allgather_sequential": False, "partition_stream_chunk_size": 0, "gather_16bit_weights_on_model_save": False,
    "stage3_gather_fp16_weights_on_model_save": False, "prefetch_bucket_size": 5e7,
}
MAPPED_AT_STAGE_3 = {"stage", "offload_param.device", "offload_optimizer.device", "stage3_prefetch_bucket_size",
                     "load_from_fp32_weights", "offload_optimizer.ratio", "zero_quantized_weights",
                     "zero_quantized_gradients", "zero_quantized_nontrainable_weights", "prefetch_bucket_size",
                     "mics_shard_size"}


@pytest.mark.parametrize("stage", [3, 2])
def test_every_zero_optimization_key_deepspeed_documents_or_reads_has_an_answer(ds, stage, capsys):
    keys = {**DOCUMENTED_ZERO_KEYS, **CODE_ONLY_ZERO_KEYS, "stage": stage}
    if stage < 3:
        del keys["offload_param"]   # needs stage 3 (validate says so: tested above)
    command_line = ds({"zero_optimization": keys}, world_size=2)
    validate(command_line.config, 2)
    table = {key.removeprefix("zero_optimization."): value for key, value in rows(command_line).items()}
    leaves = [f"{key}.{sub}" if isinstance(value, dict) and value and key.startswith("offload") else key
              for key, value in keys.items() for sub in (value if key.startswith("offload") else [None])]
    assert sorted(table) == sorted(leaves)   # each key its own row: none refused, none silently dropped
    mapped = {key for key, (status, _) in table.items() if status == MAPPED}
    if stage == 3:
        assert mapped == MAPPED_AT_STAGE_3
    else:   # the bucket and overlap keys are megalite's at stages 0-2; the stage-3 ones are not used
        assert mapped == MAPPED_AT_STAGE_3 - {"stage3_prefetch_bucket_size", "prefetch_bucket_size",
                                              "offload_param.device"} | {"overlap_comm", "reduce_bucket_size"}
    documented = [key for key in leaves if key.split(".")[0] in DOCUMENTED_ZERO_KEYS]
    counts = {status: sum(table[key][0] == status for key in documented) for status in (MAPPED, IGNORED)}
    print(f"stage {stage}: of {len(documented)} documented zero_optimization keys (offload sub-keys counted), "
          f"{counts[MAPPED]} mapped and {counts[IGNORED]} ignored at these values; all {len(leaves)} read: "
          f"{len(mapped)} mapped")
    # The values that change the result are refused, by name
    message = error_of(ds, {"zero_optimization": {"stage": stage, "load_from_fp32_weights": False,
                                                  "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                                  "zero_quantized_nontrainable_weights": True,
                                                  "zenflow": {"topk_ratio": 0.1},
                                                  "offload_optimizer": {"device": "nvme"}}}, world_size=2)
    for key in ("load_from_fp32_weights=false", "zero_quantized_weights=true", "zero_quantized_gradients=true",
                "zero_quantized_nontrainable_weights=true", "zenflow (", "offload_optimizer.device=nvme"):
        assert "zero_optimization." + key in message, key


def test_zero_optimization_true_and_the_deprecated_offload_booleans(ds):
    command_line = ds({"zero_optimization": True, "allgather_size": 5e8})   # DeepSpeed's first format: stage 1
    o = command_line.config.optimizer
    assert (o.use_distributed_optimizer, o.zero_stage) == (True, 1)
    assert rows(command_line)["allgather_size"][0] == IGNORED
    assert not ds({"zero_optimization": False}).config.optimizer.use_distributed_optimizer
    o = ds({"zero_optimization": {"stage": 2, "cpu_offload": True}}).config.optimizer
    assert o.optimizer_cpu_offload and o.zero_stage == 2
    assert "not both" in error_of(ds, {"zero_optimization": {"cpu_offload": True,
                                                             "offload_optimizer": {"device": "cpu"}}})


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
    table = rows(command_line)
    assert table["train_micro_batch_size_per_gpu"][1] == "--micro-batch-size 8; the command line's " \
                                                        "--micro-batch-size 2 wins"
    assert table["gradient_accumulation_steps"][1].endswith("= 4 micro-batches")
    assert "gives way to the command line batch sizes" in table["gradient_accumulation_steps"][1]
    # the Hydra key counts as the command line too; what the file leaves open follows from the user's value
    t = ds({"train_micro_batch_size_per_gpu": 4}, "training.micro_batch_size=1", world_size=4).config.training
    assert (t.global_batch_size, t.micro_batch_size) == (4, 1)
    t = ds({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, "--global-batch-size", "64",
           world_size=4).config.training
    assert (t.global_batch_size, t.micro_batch_size) == (64, 2)


def test_context_parallel_ranks_share_samples_so_they_are_not_data_parallel_ranks(ds):
    # 8 ranks at CP 2: data-parallel size 8 / (TP 1 x CP 2 x PP 1) = 4, the replicas DeepSpeed's data-parallel world
    # counts (the CP ranks of one replica read the same samples). World / (TP x PP) = 8 gave a global batch of 16,
    # which the run then accumulated as 2 micro-batches where the table said 1.
    file = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    cp = ("--context-parallel-size", "2", "--attention-dropout", "0")   # p2p attention takes no dropout
    command_line = ds(file, *cp, world_size=8)
    cfg = command_line.config
    assert (cfg.training.global_batch_size, cfg.training.micro_batch_size) == (8, 2)
    validate(cfg, 8)
    dims = ParallelDims.of(cfg.parallel, 8)
    assert (dims.dp, dims.micro_batches(8, 2)) == (4, 1)
    table = rows(command_line)
    assert table["train_batch_size"] == (MAPPED, "--global-batch-size 8 (derived by DeepSpeed's rule at "
                                                 "data-parallel size 4)")
    assert table["gradient_accumulation_steps"][1].endswith("= 1 micro-batches")
    # The command line's global batch: the file's accumulation gives way to 16 / (2 x DP 4) = 2, as the run does.
    command_line = ds(file, *cp, "--global-batch-size", "16", world_size=8)
    assert command_line.config.training.global_batch_size == 16
    assert ParallelDims.of(command_line.config.parallel, 8).micro_batches(16, 2) == 2
    accumulation = rows(command_line)["gradient_accumulation_steps"][1]
    assert "gives way to the command line batch sizes" in accumulation and accumulation.endswith("= 2 micro-batches")
    # A micro-batch on the command line: 2 x 1 x 4 disagrees with the file's 16, so the file's accumulation gives way.
    command_line = ds({"train_batch_size": 16, "gradient_accumulation_steps": 1}, *cp, "--micro-batch-size", "2",
                      world_size=8)
    assert (command_line.config.training.global_batch_size, command_line.config.training.micro_batch_size) == (16, 2)
    assert rows(command_line)["gradient_accumulation_steps"][1].endswith("= 2 micro-batches")
    # The arithmetic's message and a world that is not whole replicas name CP with TP and PP.
    message = error_of(ds, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                            "gradient_accumulation_steps": 1}, *cp, world_size=8)
    assert message.endswith("x data-parallel size 4 = 8 (data-parallel size = world size 8 / (TP 1 x CP 2 x PP 1))")
    message = error_of(ds, file, "--context-parallel-size", "4", world_size=6)
    assert message == (f"--deepspeed-config {message.split()[1]} its batch sizes need the data-parallel size, but "
                       f"world size 6 is not divisible by --tensor-model-parallel-size 1 x --context-parallel-size 4 "
                       f"x --pipeline-model-parallel-size 1 = 4")
    # The translation asks for DP before validation: a size below 1 is its one line too, not a ZeroDivisionError.
    assert error_of(ds, file, "--tensor-model-parallel-size", "0").endswith("--tensor-model-parallel-size must be >= "
                                                                            "1, got 0")


def test_world_size_defaults_to_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32}))
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_args(["--deepspeed-config", str(path)]).training.micro_batch_size == 8
    monkeypatch.delenv("WORLD_SIZE")
    assert parse_args(["--deepspeed-config", str(path)]).training.micro_batch_size == 32


# --- the other keys, refusals, auto, precedence, errors ----------------------------------------------------------

def test_logging_clipping_and_monitor_keys(ds, tmp_path):
    cfg = ds({"steps_per_print": 5, "wall_clock_breakdown": True, "gradient_clipping": 0.5}).config
    assert (cfg.logging.log_interval, cfg.logging.timing_log_level, cfg.optimizer.clip_grad) == (5, 1, 0.5)
    lines = ds({"train_batch_size": 8}).deepspeed_settings()
    assert any("gradient_clipping not given" in line for line in lines)
    # DeepSpeed's TensorBoard directory is output_path/job_name
    cfg = ds({"tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "gpt"}}).config
    assert cfg.logging.tensorboard_dir == str(tmp_path / "tb" / "gpt")
    assert ds({"tensorboard": {"enabled": True}}).config.logging.tensorboard_dir == "DeepSpeedJobName"
    command_line = ds({"tensorboard": {"enabled": False, "output_path": "runs"}, "wandb": {"enabled": False},
                       "csv_monitor": {"output_path": "x"}, "memory_breakdown": True, "dump_state": False})
    assert command_line.config.logging.tensorboard_dir is None
    assert {key: status for key, (status, _) in rows(command_line).items()} == {
        "tensorboard": IGNORED, "wandb": IGNORED, "csv_monitor": IGNORED, "memory_breakdown": IGNORED,
        "dump_state": IGNORED}
    message = error_of(ds, {"wandb": {"enabled": True, "project": "p"}, "comms_logger": {"enabled": True},
                            "flops_profiler": {"enabled": True}})
    assert "wandb (no Weights & Biases" in message and "comms_logger (" in message and "flops_profiler (" in message


def test_activation_checkpointing_is_full_recompute(ds):
    block = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
             "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}
    command_line = ds({"activation_checkpointing": block})
    m = command_line.config.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 1)
    table = rows(command_line)
    assert table["activation_checkpointing"][1].startswith("--recompute-granularity full --recompute-method uniform "
                                                           "--recompute-num-layers 1")
    assert table["activation_checkpointing.partition_activations"][0] == IGNORED   # TP 1: nothing to partition
    assert table["activation_checkpointing.cpu_checkpointing"][0] == IGNORED
    # with tensor parallelism, partitioning the checkpointed inputs over TP is sequence parallelism
    command_line = ds({"activation_checkpointing": block}, "--tensor-model-parallel-size", "2", world_size=2)
    assert command_line.config.parallel.sequence_parallel
    assert "sequence parallelism" in rows(command_line)["activation_checkpointing.partition_activations"][1]
    validate(command_line.config, 2)
    # the command line's recompute wins, and the file adds nothing that would contradict it
    cfg = ds({"activation_checkpointing": {}}, "--recompute-granularity", "selective").config
    assert (cfg.model.recompute_granularity, cfg.model.recompute_method) == ("selective", None)
    validate(cfg, 1)
    assert "activation_checkpointing.checkpoint_in_cpu" in error_of(ds, {"activation_checkpointing": {
        "checkpoint_in_cpu": True}})   # a key DeepSpeed does not have is refused, inside a block too


def test_unsupported_keys_are_refused_by_name_in_one_error(ds):
    message = error_of(ds, {"train_batch_size": 8, "aio": {"block_size": 1048576}, "elasticity": {"enabled": True},
                            "comms_logger": {"enabled": True}, "pipeline": {"stages": 2},
                            "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}},
                            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7,
                                                  "zero_quantized_gradients": True}})
    for name in ("elasticity", "comms_logger", "pipeline", "optimizer.params.max_grad_norm=1.0",
                 "zero_optimization.zero_quantized_gradients=true"):
        assert name in message
    assert "aio" not in message and "stage3_prefetch_bucket_size" not in message   # NVMe I/O tuning; FSDP2 prefetch
    assert message.count("megalite cannot honour") == 1


def test_a_refusal_carries_the_table_that_shows_it(ds):
    with pytest.raises(RefusedKeys) as info:
        ds(json.loads((CONFIGS / "zero_infinity_nvme.json").read_text()), world_size=2)
    message = str(info.value)
    assert "\n" not in message
    assert message.endswith("megalite cannot honour zero_optimization.offload_optimizer.device=nvme (NVMe offload), "
                            "zero_optimization.offload_param.device=nvme (NVMe offload) (remove them; see "
                            "docs/zero_and_deepspeed.md)")
    table = info.value.table
    assert "0 refused" not in table[0] and ", 2 refused" in table[0]
    assert any(line.split()[:3] == ["zero_optimization.offload_param.device", "nvme", REFUSED] for line in table)
    assert any(line.split()[:3] == ["aio", "{...}", IGNORED] for line in table)


def test_auto_keeps_megalite_values_and_the_table_shows_them(ds):
    command_line = ds({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                       "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                       "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": 0},
                       "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                 "weight_decay": "auto"}},
                       "scheduler": {"type": "WarmupDecayLR", "params": {
                           "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                           "total_num_steps": "auto", "warmup_type": "linear"}},
                       "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto", "overlap_comm": "auto",
                                             "stage3_prefetch_bucket_size": "auto",
                                             "stage3_param_persistence_threshold": "auto"},
                       "tensorboard": {"enabled": False, "output_path": "runs"}},
                      "--global-batch-size", "16", "--lr", "0.02", "--bf16", "--lr-warmup-iters", "3", world_size=2)
    cfg = command_line.config
    defaults = MegaliteConfig()
    assert (cfg.training.global_batch_size, cfg.training.micro_batch_size, cfg.optimizer.lr, cfg.training.bf16) == \
        (16, defaults.training.micro_batch_size, 0.02, True)
    assert (cfg.optimizer.weight_decay, cfg.optimizer.clip_grad, cfg.optimizer.lr_decay_style) == \
        (defaults.optimizer.weight_decay, defaults.optimizer.clip_grad, "linear")
    validate(cfg, 2)
    table = rows(command_line)
    assert table["train_batch_size"] == (MAPPED, "auto: --global-batch-size 16 (the command line's)")
    assert table["train_micro_batch_size_per_gpu"] == (MAPPED, "auto: --micro-batch-size 2 (megalite's value)")
    assert table["gradient_accumulation_steps"][1].endswith("= 4 micro-batches")
    assert table["scheduler.params.warmup_max_lr"] == (MAPPED, "auto: --lr 0.02 (the command line's)")
    assert table["optimizer.params.lr"][0] == IGNORED   # WarmupDecayLR's peak is its warmup_max_lr
    assert table["optimizer.params.betas"] == (MAPPED, "auto: --adam-beta1 0.9 --adam-beta2 0.999 (megalite's value)")
    assert table["scheduler.params.warmup_num_steps"] == (MAPPED, "auto: --lr-warmup-iters 3 (the command line's)")
    assert table["scheduler.params.total_num_steps"] == (MAPPED, "auto: --lr-decay-iters unset (megalite's value)")
    assert table["scheduler.params.warmup_min_lr"][1].startswith("nothing to set: the Trainer's default 0")
    assert table["zero_optimization.stage"] == (MAPPED, "auto: --use-distributed-optimizer=false --zero-stage 1 "
                                                         "(megalite's value)".replace("--use-distributed-optimizer",
                                                                                      "optimizer.use_distributed_"
                                                                                      "optimizer"))
    assert table["zero_optimization.reduce_bucket_size"] == (MAPPED, "auto: --ddp-bucket-size unset (megalite's "
                                                                     "value)")
    assert table["zero_optimization.stage3_prefetch_bucket_size"][0] == IGNORED   # stage 0: not used
    assert table["fp16.loss_scale"] == (IGNORED, "not used: fp16 is off (in DeepSpeed too)")
    assert table["tensorboard"][0] == IGNORED


def test_the_trainer_docs_warmup_lr_without_warmup_type_is_refused(ds):
    config = json.loads((CONFIGS / "hf_trainer_zero2_auto.json").read_text())
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto"}}
    message = error_of(ds, config, world_size=2)
    assert "megalite cannot honour scheduler.params.warmup_type=log (not given: DeepSpeed's default is log" in message
    config["scheduler"]["params"]["warmup_type"] = "linear"
    assert ds(config, world_size=2).config.optimizer.lr_decay_style == "constant"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_the_configs_people_write_are_read_key_by_key(name):
    """Every key of each file gets a row, and only the NVMe file is refused (its training at DP=2 is
    tests/multiprocess/test_deepspeed_configs.py)."""
    argv = ["--deepspeed-config", str(CONFIGS / name)]
    data = json.loads((CONFIGS / name).read_text())
    if name == "zero_infinity_nvme.json":
        with pytest.raises(RefusedKeys):
            parse_command_line(argv, world_size=2)
        return
    command_line = parse_command_line(argv, world_size=2)
    validate(command_line.config, 2)
    given = [line.split()[0] for line in command_line.deepspeed_settings()[1:]
             if line.startswith("  ") and "(not given)" not in line]
    assert {key.split(".")[0] for key in given} == set(data)
    assert command_line.deepspeed.counts()[REFUSED] == 0


def test_keys_that_only_tune_speed_or_memory_set_nothing(ds):
    speed = {"stage": 3, "contiguous_gradients": False, "sub_group_size": 1e8, "stage3_max_live_parameters": 1e8,
             "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0, "overlap_comm": False,
             "reduce_bucket_size": 1000, "allgather_bucket_size": 1000, "round_robin_gradients": True,
             "stage3_gather_16bit_weights_on_model_save": True, "zero_hpz_partition_size": 8,
             "offload_optimizer": {"device": "none", "pin_memory": True, "ratio": 0.3}}
    command_line = ds({"zero_optimization": speed, "aio": {"queue_depth": 16}, "disable_python_gc": True,
                       "checkpoint": {"tag_validation": "Fail", "parallel_write": {"pipeline_stage": True}}},
                      world_size=2)
    assert command_line.config == ds({"zero_optimization": {"stage": 3}}, world_size=2).config
    assert command_line.deepspeed.counts() == {MAPPED: 2, IGNORED: 17, REFUSED: 0}


def test_mics_shard_size_is_hsdp_at_stage_3(ds):
    """MiCS shards over groups of mics_shard_size ranks and replicates across them: HSDP's instances."""
    command_line = ds({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, world_size=4)
    assert command_line.config.parallel.num_distributed_optimizer_instances == 2
    assert rows(command_line)["zero_optimization.mics_shard_size"][0] == MAPPED
    stage2 = ds({"zero_optimization": {"stage": 2, "mics_shard_size": 2}}, world_size=4)
    assert stage2.config.parallel.num_distributed_optimizer_instances == 1   # DeepSpeed reads it at stage 3 only
    assert rows(stage2)["zero_optimization.mics_shard_size"][0] == IGNORED
    with pytest.raises(ConfigError, match="mics_shard_size 3 does not divide the data-parallel x context-parallel "
                                          "size 4"):
        ds({"zero_optimization": {"stage": 3, "mics_shard_size": 3}}, world_size=4)


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
    assert rows(command_line)["optimizer.params.lr"] == (MAPPED, "--lr 0.5; the command line's --lr 2.0 wins")


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


def test_muon_maps_onto_deepspeed_muon_update(ds):
    """DeepSpeed's Muon: Nesterov, 5 steps, sqrt(max(1, rows/cols)); its auxiliary Adam read as Adam's params."""
    o = ds({"optimizer": {"type": "Muon", "params": {"lr": 2e-2, "momentum": 0.9, "betas": [0.9, 0.95],
                                                     "weight_decay": 0.1, "muon_lr": 2e-2}}}).config.optimizer
    assert (o.optimizer, o.muon_momentum, o.muon_use_nesterov, o.muon_num_ns_steps, o.muon_scale_mode,
            o.muon_extra_scale_factor) == ("muon", 0.9, True, 5, "shape_scaling", 1.0)
    assert (o.lr, o.adam_beta2, o.weight_decay) == (2e-2, 0.95, 0.1)
    assert "optimizer.params.adam_lr=0.0002" in error_of(ds, {"optimizer": {"type": "Muon", "params": {
        "lr": 2e-2, "adam_lr": 2e-4}}})
