"""``--deepspeed-config ds.json``: a DeepSpeed JSON config read as megalite options.

People arrive with the DeepSpeed config of an earlier run. Each key megalite can honour becomes the megalite option
that does the same thing: a ``section.field`` setting, which :mod:`megalite.config.cli` applies after the YAML groups
and before the command line's own overrides and flags (so those win). Every key megalite cannot honour is refused by
name, all of them in one error: a run that silently differs from the DeepSpeed run it claims to reproduce is worse
than no run. docs/zero_and_deepspeed.md has the table, and why each refused key is refused.

What a key the file does not give means:

- A top-level key it omits (``gradient_clipping``, ``steps_per_print``, ...) leaves megalite's value alone.
- Inside a block that configures one DeepSpeed component (``optimizer``, ``scheduler``, an enabled ``fp16`` loss
  scaler, ``zero_optimization.stage``) an omitted parameter takes DeepSpeed's default, because it is part of what
  the block means there: a ``WarmupLR`` without ``warmup_type`` warms up logarithmically in DeepSpeed.
- ``"auto"`` (the Hugging Face Trainer's placeholder, which it fills from its own arguments) keeps megalite's own
  value, the equivalent of those arguments here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from megalite.config.flags import argv, get, override
from megalite.config.schema import ConfigError, MegaliteConfig, OptimizerConfig

AUTO = "auto"
_MISSING = object()   # "the file does not give this key" (None is JSON's null, a value)
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
          dict: "a JSON object"}


@dataclass(frozen=True)
class Mapping:
    """One DeepSpeed key (or a value DeepSpeed derives) and the megalite settings it became."""
    key: str                                  # "zero_optimization.stage"
    value: Any                                # its value in the file, or the derived/default value
    settings: tuple[tuple[str, Any], ...]     # (("optimizer.zero_stage", 3), ...): megalite key, value
    note: str = ""                            # why, where the value is not simply the file's


@dataclass
class Translation:
    """What a DeepSpeed config file means in megalite options."""
    name: str                                 # the path as given, for messages
    mappings: list[Mapping] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # keys accepted without setting anything, and why

    def settings(self) -> dict[str, Any]:
        """megalite key -> value, a later mapping of the same key winning (as in the file's reading order)."""
        return {key: value for m in self.mappings for key, value in m.settings}

    def overrides(self) -> list[str]:
        """The settings as Hydra overrides ``section.field=value``."""
        return [override(key, value) for key, value in self.settings().items()]

    def settings_lines(self, cfg: MegaliteConfig, user_keys: Iterable[str] = ()) -> list[str]:
        """One line per DeepSpeed key mapped (noting the settings the command line overrode), then the notes."""
        user_keys = set(user_keys)
        head = f"deepspeed config {self.name}: "
        lines = []
        for m in self.mappings:
            note = f" ({m.note})" if m.note else ""
            target = " ".join(argv(dict(m.settings))) or "nothing to set"
            line = f"{head}{m.key} {_show(m.value)}{note} -> {target}"
            overridden = [key for key, _ in m.settings if key in user_keys]
            if overridden:
                line += "; overridden by the command line: " + " ".join(argv({k: get(cfg, k) for k in overridden}))
            lines.append(line)
        return lines + [head + note for note in self.notes]


def load(path: str) -> dict:
    """The JSON object in ``path``; a missing file, bad JSON or a repeated key is a one-line ConfigError."""
    def no_duplicates(pairs):
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:   # DeepSpeed refuses these too: which of the two values was meant?
            raise ConfigError(f"--deepspeed-config {path}: key {repeated[0]!r} appears twice in one object")
        return dict(pairs)

    def no_constant(name):
        raise ConfigError(f"--deepspeed-config {path}: {name} is not a valid number here")

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(f"--deepspeed-config {path}: cannot read it ({reason})") from None
    try:
        data = json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--deepspeed-config {path}: not valid JSON ({error.msg} at line {error.lineno} "
                          f"column {error.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed-config {path}: must hold a JSON object {{...}}, not {type(data).__name__}")
    return data


def translate(path: str, world_size: int, current: MegaliteConfig, user_keys: Iterable[str] = ()) -> Translation:
    """Map the DeepSpeed config at ``path`` onto megalite settings.

    ``current`` is the configuration without the file (defaults < YAML < overrides < flags): it gives megalite's own
    value of what the file omits or leaves "auto", and the TP/PP sizes for the batch arithmetic. ``user_keys`` are
    the keys set on the command line, whose values win over the file's and take part in the batch arithmetic.
    """
    reader = _Reader(load(path), path, world_size, current, frozenset(user_keys))
    for rule in (_precision, _optimizer, _scheduler, _zero, _batch, _logging, _inert):
        rule(reader)
    reader.refuse_unread()
    if reader.autos:
        reader.note(f"auto, so megalite's own value is kept: {', '.join(reader.autos)}")
    if reader.refused:
        raise ConfigError(f"--deepspeed-config {path}: megalite cannot honour {', '.join(reader.refused)} (remove "
                          f"{'it' if len(reader.refused) == 1 else 'them'}; see docs/zero_and_deepspeed.md)")
    return reader.translation


class _Reader:
    """Walks the file, remembering every key a rule has read: whatever no rule read is refused by name at the end."""

    def __init__(self, data: dict, name: str, world_size: int, current: MegaliteConfig, user_keys: frozenset):
        self.data, self.name, self.world_size, self.current, self.user_keys = data, name, world_size, current, user_keys
        self.translation = Translation(name)
        self.read: set[str] = set()      # a block's path covers everything under it
        self.refused: list[str] = []
        self.autos: list[str] = []       # keys left "auto"

    # --- reading -----------------------------------------------------------------------------------------------
    def peek(self, path: str) -> Any:
        """The value at a dotted path, or _MISSING, without marking it read."""
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def take(self, path: str, kind: type, default: Any = _MISSING) -> Any:
        """The value at ``path`` checked to be of ``kind`` (marked read); ``default`` if absent; _MISSING for "auto"
        (noted: megalite keeps its own value)."""
        value = self.peek(path)
        self.read.add(path)
        if value is _MISSING:
            return default
        if value == AUTO and kind is not dict:
            self.autos.append(path)
            return _MISSING
        return self.check(path, value, kind)

    def check(self, path: str, value: Any, kind: type) -> Any:
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if isinstance(value, float) and not math.isfinite(value):   # 1e400 reads as inf
            ok = False
        elif kind is int and isinstance(value, float) and value.is_integer():   # 5e8 is a float in JSON
            ok, value = True, int(value)
        if not ok:
            raise ConfigError(f"--deepspeed-config {self.name}: {path} must be {_KINDS[kind]}, got {_show(value)}")
        return value

    def block(self, path: str) -> Optional[dict]:
        """The object at ``path`` (not marked read: its keys are read one by one), or None if absent."""
        value = self.peek(path)
        return None if value is _MISSING else self.check(path, value, dict)

    # --- results -----------------------------------------------------------------------------------------------
    def map(self, key: str, value: Any, settings: dict[str, Any], note: str = "") -> None:
        self.translation.mappings.append(Mapping(key, value, tuple(settings.items()), note))

    def map_default(self, key: str, value: Any, setting: str, megalite_value: Any) -> None:
        """DeepSpeed's default for an omitted parameter; shown only where it differs from megalite's value."""
        if self.effective(setting) != megalite_value:
            self.map(key, value, {setting: megalite_value}, "not given: DeepSpeed's default")

    def param(self, path: str, kind: type, setting: str, default: Any = _MISSING, convert=None, note: str = "") -> Any:
        """Map the value at ``path`` onto ``setting`` (through ``convert``); an omitted one takes DeepSpeed's
        ``default`` where there is one. Returns the value (_MISSING if absent or "auto")."""
        value = self.take(path, kind)
        convert = convert or (lambda v: v)
        if value is not _MISSING:
            self.map(path, value, {setting: convert(value)}, note)
        elif default is not _MISSING and self.peek(path) is _MISSING:
            self.map_default(path, default, setting, convert(default))
        return value

    def note(self, text: str) -> None:
        self.translation.notes.append(text)

    def refuse(self, path: str, value: Any = _MISSING, why: str = "") -> None:
        self.read.add(path)
        shown = path if value is _MISSING else f"{path}={_show(value)}"
        self.refused.append(f"{shown} ({why})" if why else shown)

    def current_value(self, key: str) -> Any:
        return get(self.current, key)

    def effective(self, key: str) -> Any:
        """The value ``key`` will have: the command line's if it sets it, else the file's so far, else megalite's."""
        if key not in self.user_keys:
            for m in reversed(self.translation.mappings):
                for k, value in reversed(m.settings):
                    if k == key:
                        return value
        return self.current_value(key)

    def refuse_unread(self, node: Optional[dict] = None, prefix: str = "") -> None:
        """Refuse every key no rule read: a whole unread block by its name, else its unread keys one by one."""
        for key, value in (self.data if node is None else node).items():
            path = prefix + key
            if path in self.read:
                continue
            if value == AUTO:
                self.autos.append(path)
            elif isinstance(value, dict) and not prefix and value.get("enabled") is False:
                self.note(f"{path} disabled: asks for nothing")
            elif isinstance(value, dict) and any(p.startswith(path + ".") for p in self.read):
                self.refuse_unread(value, path + ".")
            else:
                self.refuse(path, _MISSING if isinstance(value, dict) else value)


# --- rules, one per group of keys, in reading order ---------------------------------------------------------------

def _precision(r: _Reader) -> None:
    """bf16 / fp16 and the fp16 loss scaler (DeepSpeed's dynamic rule is megalite's: back off after ``hysteresis``
    overflowing steps, double after ``loss_scale_window`` clean ones, hysteresis reset when the scale grows)."""
    for name in ("bf16", "bfloat16"):   # DeepSpeed reads either spelling
        if r.block(name) is not None:
            enabled = r.take(f"{name}.enabled", bool, default=False)
            if enabled is not _MISSING:
                r.map(f"{name}.enabled", enabled, {"training.bf16": enabled})
    if r.block("fp16") is None:
        return
    enabled = r.take("fp16.enabled", bool, default=False)
    if enabled is not _MISSING:
        r.map("fp16.enabled", enabled, {"training.fp16": enabled})
    params = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
              "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads")
    if not r.effective("training.fp16"):   # DeepSpeed ignores the scaler's parameters too
        given = [p for p in params if r.peek(f"fp16.{p}") is not _MISSING]
        r.read.update(f"fp16.{p}" for p in given)
        if given:
            r.note(f"fp16.{', fp16.'.join(given)}: not used, fp16 is off")
        return
    # loss_scale 0 (DeepSpeed's default) is dynamic scaling, megalite's --loss-scale unset
    r.param("fp16.loss_scale", float, "optimizer.loss_scale", 0.0, lambda v: v or None,
            "0: dynamic" if r.peek("fp16.loss_scale") == 0 else "")
    power = r.peek("fp16.initial_scale_power")
    if isinstance(power, int) and not isinstance(power, bool) and not 0 <= power <= 1000:
        raise ConfigError(f"--deepspeed-config {r.name}: fp16.initial_scale_power must be between 0 and 1000, got "
                          f"{power}")
    r.param("fp16.initial_scale_power", int, "optimizer.initial_loss_scale", 16, lambda v: 2.0 ** v)
    r.param("fp16.loss_scale_window", int, "optimizer.loss_scale_window", 1000)
    r.param("fp16.hysteresis", int, "optimizer.hysteresis", 2)
    r.param("fp16.min_loss_scale", float, "optimizer.min_loss_scale", 1.0)
    for key, why in [("consecutive_hysteresis", "megalite resets the hysteresis only when the scale grows"),
                     ("auto_cast", "megalite keeps fp16 parameters rather than autocasting"),
                     ("fp16_master_weights_and_grads", "megalite keeps fp32 main parameters and gradients")]:
        if r.take(f"fp16.{key}", bool) is True:
            r.refuse(f"fp16.{key}", True, why)


_SCHEDULES_SETTING_LR = ("WarmupLR", "WarmupDecayLR")   # their warmup_max_lr, not the optimizer's lr, is the peak


def _optimizer(r: _Reader) -> None:
    """Adam/AdamW onto megalite's AdamW; omitted parameters take the defaults of DeepSpeed's Adam (lr 1e-3, betas
    (0.9, 0.999), eps 1e-8, weight decay 0)."""
    if r.block("optimizer") is None:
        return
    if r.peek("optimizer.type") is _MISSING:
        raise ConfigError(f"--deepspeed-config {r.name}: optimizer needs a type (Adam or AdamW)")
    kind = r.take("optimizer.type", str)
    kind = "adamw" if kind is _MISSING else kind.lower()   # DeepSpeed compares the names in lower case
    if kind not in ("adam", "adamw"):
        r.refuse("optimizer.type", r.peek("optimizer.type"), "megalite's optimizer is AdamW")
        r.read.add("optimizer.params")
        return
    r.block("optimizer.params")
    adam_w_mode = r.take("optimizer.params.adam_w_mode", bool, default=True)
    if kind == "adam" and adam_w_mode is False:   # "AdamW" is decoupled whatever adam_w_mode says
        r.refuse("optimizer.params.adam_w_mode", False, "Adam with L2 regularization; megalite's is AdamW")
    r.take("optimizer.params.torch_adam", bool)   # torch's Adam or DeepSpeed's fused one: the same update
    for key, wanted in [("bias_correction", True), ("amsgrad", False)]:
        value = r.take(f"optimizer.params.{key}", bool)
        if value not in (wanted, _MISSING):
            r.refuse(f"optimizer.params.{key}", value, "megalite's AdamW does not do that")
    schedule = r.peek("scheduler.type")
    if schedule in _SCHEDULES_SETTING_LR and r.peek("optimizer.params.lr") not in (_MISSING, AUTO):
        lr = r.take("optimizer.params.lr", float)
        r.note(f"optimizer.params.lr {_show(lr)}: not used, DeepSpeed's {schedule} sets the learning rate from its "
               f"warmup_max_lr")
    elif schedule not in _SCHEDULES_SETTING_LR:
        r.param("optimizer.params.lr", float, "optimizer.lr", 1e-3)
    betas = r.take("optimizer.params.betas", list)
    if betas is not _MISSING:
        if len(betas) != 2:
            raise ConfigError(f"--deepspeed-config {r.name}: optimizer.params.betas must be [beta1, beta2], got "
                              f"{_show(betas)}")
        b1, b2 = (r.check("optimizer.params.betas", b, float) for b in betas)
        r.map("optimizer.params.betas", betas, {"optimizer.adam_beta1": b1, "optimizer.adam_beta2": b2})
    elif r.peek("optimizer.params.betas") is _MISSING:
        r.map_default("optimizer.params.betas", [0.9, 0.999], "optimizer.adam_beta1", 0.9)
        r.map_default("optimizer.params.betas", [0.9, 0.999], "optimizer.adam_beta2", 0.999)
    r.param("optimizer.params.eps", float, "optimizer.adam_eps", 1e-8)
    r.param("optimizer.params.weight_decay", float, "optimizer.weight_decay", 0.0)


def _scheduler(r: _Reader) -> None:
    """DeepSpeed's warm-up schedules onto megalite's linear warm-up from 0 followed by a decay to min_lr.

    DeepSpeed (runtime/lr_schedules.py): WarmupLR ramps warmup_min_lr -> warmup_max_lr over max(2, warmup_num_steps)
    steps, then stays; WarmupDecayLR then decays linearly to warmup_min_lr at total_num_steps; WarmupCosineLR ramps
    warmup_min_ratio -> 1 times the optimizer's lr, then follows a cosine to cos_min_ratio x lr at total_num_steps.
    The ramp is logarithmic unless warmup_type is "linear", and starts from a non-zero value if asked to: megalite's
    warm-up can do neither, so those are refused.
    """
    if r.block("scheduler") is None:
        return
    if r.peek("scheduler.type") in (_MISSING, AUTO):
        raise ConfigError(f"--deepspeed-config {r.name}: scheduler needs a type (WarmupLR, WarmupDecayLR or "
                          f"WarmupCosineLR)")
    kind = r.take("scheduler.type", str)
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):   # DeepSpeed's names are case-sensitive
        r.refuse("scheduler.type", kind, "megalite schedules are a linear warm-up, then constant, linear or cosine")
        r.read.add("scheduler.params")
        return
    p = "scheduler.params"
    r.block(p)
    warmup_type = r.take(f"{p}.warmup_type", str, default="log")
    if warmup_type not in ("linear", _MISSING):
        why = "megalite's warm-up is linear"
        if r.peek(f"{p}.warmup_type") is _MISSING:
            why = "not given: DeepSpeed's default is log; " + why + ', give "linear"'
        r.refuse(f"{p}.warmup_type", warmup_type, why)
    last = r.take(f"{p}.last_batch_iteration", int, default=-1)
    if last not in (-1, _MISSING):
        r.refuse(f"{p}.last_batch_iteration", last, "megalite resumes the schedule from its checkpoints")
    if kind == "WarmupCosineLR":
        start = r.take(f"{p}.warmup_min_ratio", float, default=0.0)
        start_name = "warmup_min_ratio"
    else:
        start = r.take(f"{p}.warmup_min_lr", float, default=0.0)
        start_name = "warmup_min_lr"
    if start not in (0, _MISSING):
        r.refuse(f"{p}.{start_name}", start, "megalite warms up from 0")
    steps = r.take(f"{p}.warmup_num_steps", int, default=1000)
    if steps is not _MISSING:
        warmup = max(2, steps)   # DeepSpeed's own floor
        note = "DeepSpeed warms up over at least 2 steps" if warmup != steps else ""
        if r.peek(f"{p}.warmup_num_steps") is _MISSING:
            note = "not given: DeepSpeed's default"
        r.map(f"{p}.warmup_num_steps", steps, {"optimizer.lr_warmup_iters": warmup}, note)
    if kind in _SCHEDULES_SETTING_LR:
        peak = r.take(f"{p}.warmup_max_lr", float, default=1e-3)
        if peak is not _MISSING:
            note = "not given: DeepSpeed's default" if r.peek(f"{p}.warmup_max_lr") is _MISSING else ""
            r.map(f"{p}.warmup_max_lr", peak, {"optimizer.lr": peak}, note)
    if kind == "WarmupLR":
        r.map("scheduler.type", kind, {"optimizer.lr_decay_style": "constant"})
        return
    total = r.take(f"{p}.total_num_steps", int)
    if r.peek(f"{p}.total_num_steps") is _MISSING:
        raise ConfigError(f"--deepspeed-config {r.name}: {kind} needs {p}.total_num_steps (DeepSpeed requires it "
                          f"too; \"auto\" keeps megalite's --lr-decay-iters)")
    decay = {} if total is _MISSING else {"optimizer.lr_decay_iters": total}
    if kind == "WarmupDecayLR":
        r.map("scheduler.type", kind, {"optimizer.lr_decay_style": "linear", "optimizer.min_lr": 0.0, **decay},
              "decays to warmup_min_lr, 0")
        return
    ratio = r.take(f"{p}.cos_min_ratio", float, default=1e-4)
    settings = {"optimizer.lr_decay_style": "cosine", **decay}
    note = ""
    if ratio is not _MISSING:   # a ratio of the lr the run will have, the command line's --lr included
        lr = r.effective("optimizer.lr")
        settings["optimizer.min_lr"] = ratio * lr
        note = f"min lr = cos_min_ratio {_show(ratio)} x lr {_show(lr)}"
        if r.peek(f"{p}.cos_min_ratio") is _MISSING:
            note += ", cos_min_ratio not given: DeepSpeed's default"
    r.map("scheduler.type", kind, settings, note)


def _zero(r: _Reader) -> None:
    """ZeRO stage and offload. Stage 0 is plain data parallelism, 1-2 megalite's distributed optimizer, 3 FSDP2."""
    z = "zero_optimization"
    if r.block(z) is None:
        return
    stage = r.take(f"{z}.stage", int, default=0)
    if stage is not _MISSING and stage not in (0, 1, 2, 3):
        raise ConfigError(f"--deepspeed-config {r.name}: {z}.stage must be 0, 1, 2 or 3, got {stage}")
    if stage is not _MISSING:
        note = "not given: DeepSpeed's default" if r.peek(f"{z}.stage") is _MISSING else ""
        wanted = {f"optimizer.{name}": value for name, value in OptimizerConfig.zero_settings(stage).items()}
        # The option that names the stage, and the other only where it does not hold already: "--zero-stage 3",
        # not also "optimizer.use_distributed_optimizer=false".
        main = {0: ("optimizer.use_distributed_optimizer",), 3: ("optimizer.zero_stage",)}.get(stage, tuple(wanted))
        settings = {key: value for key, value in wanted.items() if key in main or r.effective(key) != value}
        r.map(f"{z}.stage", stage, settings, note)
    else:   # "auto": the stage megalite is configured for decides what the other keys mean
        stage = r.current.optimizer.zero_level
    for block, setting in [("offload_optimizer", "optimizer.optimizer_cpu_offload"),
                           ("offload_param", "optimizer.offload_params")]:
        if r.block(f"{z}.{block}") is None:
            continue
        device = r.take(f"{z}.{block}.device", str, default="none")
        if device == "nvme":
            r.refuse(f"{z}.{block}.device", device, "NVMe offload")
        elif device in ("cpu", "none"):
            r.map(f"{z}.{block}.device", device, {setting: device == "cpu"})
        elif device is not _MISSING:
            raise ConfigError(f"--deepspeed-config {r.name}: {z}.{block}.device must be cpu, nvme or none, got "
                              f"{_show(device)}")
        r.take(f"{z}.{block}.pin_memory", bool)   # page-locked host buffers: speed only, same results
        if device != "nvme":   # NVMe's own tuning keys mean nothing without NVMe (DeepSpeed ignores them too)
            for key in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write",
                        "fast_init"):
                r.read.add(f"{z}.{block}.{key}")
        ratio = r.take(f"{z}.{block}.ratio", float, default=1.0)
        if ratio not in (1, _MISSING):
            r.refuse(f"{z}.{block}.ratio", ratio, "partial offload")
    overlap = r.take(f"{z}.overlap_comm", bool)
    if overlap is not _MISSING and stage < 3:
        r.map(f"{z}.overlap_comm", overlap, {"optimizer.overlap_grad_reduce": overlap})
    elif overlap is True:
        r.note(f"{z}.overlap_comm true: FSDP2 (ZeRO-3) always overlaps its gathers and reductions")
    elif overlap is False:
        r.refuse(f"{z}.overlap_comm", False, "FSDP2 (ZeRO-3) always overlaps")
    reduce_bucket = r.take(f"{z}.reduce_bucket_size", int) if stage < 3 else _MISSING
    if reduce_bucket is not _MISSING:
        r.map(f"{z}.reduce_bucket_size", reduce_bucket, {"optimizer.ddp_bucket_size": reduce_bucket})
    gather_bucket = r.peek(f"{z}.allgather_bucket_size")
    if stage < 3 and gather_bucket is not _MISSING and gather_bucket != AUTO:
        gather_bucket = r.take(f"{z}.allgather_bucket_size", int)
        if stage == 0 or gather_bucket == reduce_bucket:   # megalite gathers in its gradient buckets
            r.note(f"{z}.allgather_bucket_size {gather_bucket}: " + (
                "not used at stage 0" if stage == 0 else "megalite gathers parameters in its reduce buckets"))
        else:
            r.refuse(f"{z}.allgather_bucket_size", gather_bucket, "megalite gathers parameters in its reduce buckets, "
                                                                   "so it must equal reduce_bucket_size")
    # What megalite's engine does anyway is accepted; asking otherwise is refused (left unread).
    for key, megalite_does in [("contiguous_gradients", True), ("reduce_scatter", True),
                               ("allgather_partitions", True), ("round_robin_gradients", False)]:
        if r.peek(f"{z}.{key}") is megalite_does:
            r.read.add(f"{z}.{key}")


def _batch(r: _Reader) -> None:
    """train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size.

    DeepSpeed's resolution (runtime/config.py): any two of the three give the third (by integer division); the
    batch size alone means gradient accumulation 1 and micro-batch batch / DP; the micro-batch alone means
    accumulation 1 and batch micro x DP; all three must agree. megalite has only the global and micro-batch sizes
    (accumulation is their quotient over DP), so the command line's --global-batch-size / --micro-batch-size (or
    their Hydra keys) are put in place of the file's values before the resolution, and gradient_accumulation_steps
    gives way when that leaves the three disagreeing.
    """
    names = {"train_batch_size": "training.global_batch_size",
             "train_micro_batch_size_per_gpu": "training.micro_batch_size",
             "gradient_accumulation_steps": None}
    file = {name: r.take(name, int) for name in names}
    file = {name: value for name, value in file.items() if value is not _MISSING}
    for name, value in file.items():
        if value < 1:
            raise ConfigError(f"--deepspeed-config {r.name}: {name} must be >= 1, got {value}")
    user = {name: r.current_value(key) for name, key in names.items() if key in r.user_keys}
    if not file:
        return
    p = r.current.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if r.world_size % (tp * pp):
        raise ConfigError(f"--deepspeed-config {r.name}: its batch sizes need the data-parallel size, but world size "
                          f"{r.world_size} is not divisible by tensor-model-parallel-size {tp} x "
                          f"pipeline-model-parallel-size {pp}")
    dp = r.world_size // (tp * pp)
    values = {**file, **user}
    source = {name: ("command line" if name in user else "file") for name in values}
    t, m, g = (values.get(name) for name in names)
    if t is not None and m is not None and g is not None and user and t != m * g * dp:
        r.note(f"gradient_accumulation_steps {g}: gives way to the command line's batch sizes (megalite accumulates "
               f"global / (micro x data-parallel size))")
        g = None
        del source["gradient_accumulation_steps"]
    derived = ""
    if t is not None and m is not None and g is None:
        g, derived = t // m // dp, "gradient_accumulation_steps"
    elif t is not None and g is not None and m is None:
        m, derived = t // dp // g, "train_micro_batch_size_per_gpu"
    elif m is not None and g is not None and t is None:
        t, derived = m * g * dp, "train_batch_size"
    elif t is not None and m is None:
        g, m, derived = 1, t // dp, "train_micro_batch_size_per_gpu"
    elif m is not None and t is None:
        g, t, derived = 1, m * dp, "train_batch_size"
    elif t is None and m is None:
        raise ConfigError(f"--deepspeed-config {r.name}: gradient_accumulation_steps alone does not fix the batch: "
                          f"give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed needs one of them too)")
    arithmetic = (f"train_batch_size {t} {_origin(source, 'train_batch_size', derived)}"
                  f"!= train_micro_batch_size_per_gpu {m} {_origin(source, 'train_micro_batch_size_per_gpu', derived)}"
                  f"x gradient_accumulation_steps {g} {_origin(source, 'gradient_accumulation_steps', derived)}"
                  f"x data-parallel size {dp} = {m * g * dp}")
    if t != m * g * dp or m < 1 or g < 1:
        raise ConfigError(f"--deepspeed-config {r.name}: {' '.join(arithmetic.split())} (data-parallel size = world "
                          f"size {r.world_size} / (TP {tp} x PP {pp}))")
    # The file's own values are mapped even where the command line overrides them, so the start of the run can say so.
    how = f"derived by DeepSpeed's rule at data-parallel size {dp}"
    for name, value in (("train_batch_size", t), ("train_micro_batch_size_per_gpu", m)):
        if name in file:
            r.map(name, file[name], {names[name]: file[name]})
        elif name == derived:
            r.map(name, value, {names[name]: value}, how)
    if "gradient_accumulation_steps" in source or derived == "gradient_accumulation_steps":
        r.note(f"gradient_accumulation_steps {g}{' (' + how + ')' if derived == 'gradient_accumulation_steps' else ''}"
               f": nothing to set, megalite accumulates global / (micro x data-parallel size) = {g} micro-batches")


def _origin(source: dict, name: str, derived: str) -> str:
    """Where a value of the batch arithmetic came from, for the error message ('' for the file itself)."""
    if name == derived:
        return "(derived) "
    return "(from the command line) " if source.get(name) == "command line" else ""


def _logging(r: _Reader) -> None:
    """Top-level keys with a megalite option of the same meaning."""
    steps = r.take("steps_per_print", int)
    if steps is not _MISSING:
        r.map("steps_per_print", steps, {"logging.log_interval": steps})
    breakdown = r.take("wall_clock_breakdown", bool)
    if breakdown is not _MISSING:   # forward/backward, reduction and step times, as DeepSpeed's breakdown
        r.map("wall_clock_breakdown", breakdown, {"logging.timing_log_level": 1 if breakdown else 0})
    clip = r.take("gradient_clipping", float)
    if clip is not _MISSING:
        if clip < 0:
            raise ConfigError(f"--deepspeed-config {r.name}: gradient_clipping must be >= 0, got {_show(clip)}")
        r.map("gradient_clipping", clip, {"optimizer.clip_grad": clip}, "0: no clipping" if clip == 0 else "")
    elif r.peek("gradient_clipping") is _MISSING and r.effective("optimizer.clip_grad") != 0:
        r.note(f"gradient_clipping not given: megalite clips at --clip-grad {_show(r.effective('optimizer.clip_grad'))}"
               f" (DeepSpeed would not clip; give 0 to match it)")


def _inert(r: _Reader) -> None:
    """Keys that ask for what megalite does anyway, or only permit something: accepted and noted. Any other value
    of them is left unread, so refused."""
    for key, accepted, why in [
            ("zero_allow_untested_optimizer", (True, False), "a permission; megalite's optimizer is its own AdamW"),
            ("zero_force_ds_cpu_optimizer", (True, False), "a permission; megalite's CPU optimizer is its own"),
            ("prescale_gradients", (False,), "megalite divides gradients after reducing them"),
            ("gradient_predivide_factor", (1, 1.0), "megalite divides gradients after reducing them"),
            ("sparse_gradients", (False,), "megalite's gradients are dense"),
            ("memory_breakdown", (False,), "megalite prints peak memory in its log anyway"),
            ("communication_data_type", (None, "fp32"), "megalite reduces gradients in fp32")]:
        value = r.peek(key)
        if value is not _MISSING and any(value is a or (type(value) is type(a) and value == a) for a in accepted):
            r.read.add(key)
            r.note(f"{key} {_show(value)}: nothing to set ({why})")


# --- helpers ------------------------------------------------------------------------------------------------------

def _show(value: Any) -> str:
    """A JSON value as written in messages: strings bare (device=nvme), the rest as JSON."""
    if value is _MISSING:
        return "(not given)"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value)) if abs(value) >= 1e4 else repr(value)
    return json.dumps(value)
