"""``--deepspeed-config ds.json``: a DeepSpeed JSON config read as megalite options, key by key.

People arrive with the DeepSpeed config of an earlier run. Every key in it gets one of three answers (the rule, and
the table of every key, are in docs/zero_and_deepspeed.md):

- **mapped**: megalite honours it. The key becomes the megalite option that does the same thing, a ``section.field``
  setting that :mod:`megalite.config.cli` applies after the YAML groups and before the command line's own overrides
  and flags (so those win), or megalite already does what it asks and nothing needs setting.
- **ignored**: it only tunes DeepSpeed's speed or memory and megalite has no counterpart (``sub_group_size``,
  ``stage3_max_live_parameters``, ``pin_memory``), or only asks for a diagnostic print: accepted and listed, with
  why. What is trained is the same.
- **refused**: its value would change the result (a logarithmic warm-up, quantized gradients, an optimizer megalite
  does not have) or megalite cannot provide it (NVMe offload, W&B), or megalite does not know the key. All of them
  are named in one error: a run that silently differs from the DeepSpeed run it claims to reproduce is worse than no
  run.

The start of a run prints the table (:meth:`Translation.table`): each key, its value and what became of it; a
refused file prints it too, before its one-line error (the error carries it, :class:`RefusedKeys`).

What a key the file does not give, or gives as ``"auto"``, means:

- A top-level key it omits (``gradient_clipping``, ``steps_per_print``, ...) leaves megalite's value alone, and so
  does an omitted speed or memory knob (``reduce_bucket_size``): megalite's defaults are tuned for its engines.
- Inside a block that configures one DeepSpeed component (``optimizer``, ``scheduler``, an enabled ``fp16`` loss
  scaler, ``zero_optimization.stage``) an omitted parameter takes DeepSpeed's default, because it is part of what
  the block means there: a ``WarmupLR`` without ``warmup_type`` warms up logarithmically in DeepSpeed.
- ``"auto"`` (the Hugging Face Trainer's placeholder, which it fills from its own arguments) keeps megalite's own
  value, the command line's or megalite's default (the equivalent of those arguments here); the table shows it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from megalite.config.dims import ParallelDims
from megalite.config.flags import BY_KEY, argv, get, override
from megalite.config.schema import ConfigError, MegaliteConfig, OptimizerConfig

AUTO = "auto"
MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"
_MISSING = object()   # "the file does not give this key" (None is JSON's null, a value)
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
          dict: "a JSON object"}


@dataclass(frozen=True)
class Row:
    """One DeepSpeed key of the file (or one DeepSpeed derives or defaults) and what became of it."""
    key: str                                      # "zero_optimization.stage"
    value: Any                                    # the file's value, AUTO, or _MISSING (not given)
    status: str                                   # MAPPED, IGNORED or REFUSED
    settings: tuple[tuple[str, Any], ...] = ()    # mapped: (("optimizer.zero_stage", 3), ...), megalite key, value
    keeps: tuple[str, ...] = ()                   # "auto": the megalite keys whose own value the run keeps
    note: str = ""                                # why; for an ignored or refused key, the reason


class RefusedKeys(ConfigError):
    """A file with keys megalite cannot honour: one line naming them all, and the table (``table``) to print."""

    def __init__(self, message: str, table: list[str]):
        super().__init__(message)
        self.table = table


@dataclass
class Translation:
    """What a DeepSpeed config file means in megalite options."""
    name: str                                     # the path as given, for messages
    rows: list[Row] = field(default_factory=list)      # in reading order: a later setting of a key wins
    notes: list[str] = field(default_factory=list)     # remarks on keys the file does not give
    user_keys: frozenset = frozenset()            # megalite keys the command line sets (they win over the file)
    order: list[int] = field(default_factory=list)     # the rows in the file's order, for the table

    def settings(self) -> dict[str, Any]:
        """megalite key -> value, a later mapping of the same key winning (as in the file's reading order)."""
        return {key: value for row in self.rows for key, value in row.settings}

    def overrides(self) -> list[str]:
        """The settings as Hydra overrides ``section.field=value``."""
        return [override(key, value) for key, value in self.settings().items()]

    def apply(self, cfg: MegaliteConfig) -> MegaliteConfig:
        """``cfg`` with the file's settings, except those of keys the command line sets (``user_keys``, already in
        ``cfg``): what :mod:`megalite.config.cli` composes with Hydra, for callers that build a config without it."""
        changes: dict[str, dict[str, Any]] = {}
        for key, value in self.settings().items():
            if key not in self.user_keys:
                section, name = key.split(".")
                changes.setdefault(section, {})[name] = value
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)
                                           for section, values in changes.items()})

    def counts(self) -> dict[str, int]:
        """How many of the file's keys were mapped, ignored and refused (keys it does not give not counted)."""
        given = [row for row in self.rows if row.value is not _MISSING]
        return {status: sum(row.status == status for row in given) for status in (MAPPED, IGNORED, REFUSED)}

    def table(self, value_of: Callable[[str], Any]) -> list[str]:
        """The effective-settings table: a head line, then one line per key (value, status, what it became), then
        the notes. ``value_of`` gives a megalite key's value in the run (what an "auto" key kept)."""
        head = f"deepspeed config {self.name}: "
        counts = self.counts()
        lines = [head + f"{sum(counts.values())} keys: " + ", ".join(f"{n} {s}" for s, n in counts.items())
                 + " (the command line wins over the file)"]
        key_width = max((len(row.key) for row in self.rows), default=0)
        value_width = min(max((len(_shown_value(row.value)) for row in self.rows), default=0), 14)
        for row in (self.rows[i] for i in self.order or range(len(self.rows))):
            lines.append(f"  {row.key:<{key_width}}  {_shown_value(row.value):<{value_width}}  {row.status:<7}  "
                         f"{self._effect(row, value_of)}")
        return lines + [head + note for note in self.notes]

    def settings_lines(self, cfg: MegaliteConfig) -> list[str]:
        """The table for the run ``cfg`` (the configuration after the file and the command line)."""
        return self.table(lambda key: get(cfg, key))

    def _effect(self, row: Row, value_of: Callable[[str], Any]) -> str:
        note = row.note
        if row.status != MAPPED:
            return note
        if row.keeps:
            kept = " ".join(_shown_setting(key, value_of(key)) for key in row.keeps)
            source = "the command line's" if any(key in self.user_keys for key in row.keeps) else "megalite's value"
            return f"auto: {kept} ({source})" + (f"; {note}" if note else "")
        if not row.settings:
            return "nothing to set" + (f": {note}" if note else "")
        text = " ".join(argv(dict(row.settings))) + (f" ({note})" if note else "")
        overridden = [key for key, _ in row.settings if key in self.user_keys]
        if overridden:
            text += "; the command line's " + " ".join(_shown_setting(k, value_of(k)) for k in overridden) + " wins"
        return text


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
    Raises :class:`RefusedKeys` naming every key megalite cannot honour.
    """
    reader = _Reader(load(path), path, world_size, current, frozenset(user_keys))
    for rule in (_precision, _optimizer, _scheduler, _zero, _batch, _recompute, _monitoring, _checkpointing,
                 _communication):
        rule(reader)
    reader.refuse_unread()
    translation = reader.finish()
    refused = [row for row in translation.rows if row.status == REFUSED]
    if refused:
        named = ", ".join((f"{row.key}={_show(row.value)}" if not isinstance(row.value, dict) else row.key)
                          + (f" ({row.note})" if row.note else "") for row in refused)
        raise RefusedKeys(f"--deepspeed-config {path}: megalite cannot honour {named} (remove "
                          f"{'it' if len(refused) == 1 else 'them'}; see docs/zero_and_deepspeed.md)",
                          translation.table(reader.effective))
    return translation


class _Reader:
    """Walks the file, remembering every key a rule has read: whatever no rule read is refused by name at the end."""

    def __init__(self, data: dict, name: str, world_size: int, current: MegaliteConfig, user_keys: frozenset):
        self.data, self.name, self.world_size, self.current, self.user_keys = data, name, world_size, current, user_keys
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.read: set[str] = set()      # a block's path covers everything under it

    # --- reading -----------------------------------------------------------------------------------------------
    def peek(self, path: str) -> Any:
        """The value at a dotted path, or _MISSING, without marking it read."""
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def take(self, path: str, kind: type, default: Any = _MISSING, keeps: Iterable[str] = ()) -> Any:
        """The value at ``path`` checked to be of ``kind`` (marked read); ``default`` if absent; _MISSING for "auto",
        which becomes a row keeping megalite's own value of the settings ``keeps``."""
        value = self.peek(path)
        self.read.add(path)
        if value is _MISSING:
            return default
        if value == AUTO and kind is not dict:
            self.keep(path, *keeps)
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

    def given(self, path: str) -> bool:
        return self.peek(path) is not _MISSING

    # --- results -----------------------------------------------------------------------------------------------
    def map(self, key: str, value: Any, settings: dict[str, Any], note: str = "") -> None:
        self.rows.append(Row(key, value, MAPPED, tuple(settings.items()), note=note))

    def keep(self, key: str, *settings: str) -> None:
        """An "auto" key: megalite keeps its own value of ``settings`` (shown in the table)."""
        self.read.add(key)
        self.rows.append(Row(key, AUTO, MAPPED, keeps=settings))

    def matches(self, key: str, value: Any, why: str) -> None:
        """A key asking for what megalite does anyway: mapped, nothing to set."""
        self.read.add(key)
        self.rows.append(Row(key, value, MAPPED, note=why))

    def ignore(self, key: str, value: Any, why: str) -> None:
        self.read.add(key)
        self.rows.append(Row(key, value, IGNORED, note=why))

    def refuse(self, key: str, value: Any = _MISSING, why: str = "") -> None:
        self.read.add(key)
        self.rows.append(Row(key, self.peek(key) if value is _MISSING else value, REFUSED, note=why))

    def map_default(self, key: str, value: Any, setting: str, megalite_value: Any) -> None:
        """DeepSpeed's default for an omitted parameter; listed only where it differs from megalite's value."""
        if self.effective(setting) != megalite_value:
            self.rows.append(Row(key, _MISSING, MAPPED, ((setting, megalite_value),),
                                 note=f"not given: DeepSpeed's default {_show(value)}"))

    def param(self, path: str, kind: type, setting: str, default: Any = _MISSING, convert=None, note: str = "") -> Any:
        """Map the value at ``path`` onto ``setting`` (through ``convert``); an omitted one takes DeepSpeed's
        ``default`` where there is one; "auto" keeps megalite's. Returns the value (_MISSING if absent or "auto")."""
        value = self.take(path, kind, keeps=(setting,))
        convert = convert or (lambda v: v)
        if value is not _MISSING:
            self.map(path, value, {setting: convert(value)}, note)
        elif default is not _MISSING and not self.given(path):
            self.map_default(path, default, setting, convert(default))
        return value

    def either(self, path: str, kind: type, wanted: tuple, why: str, refusal: str) -> Any:
        """A key megalite honours only with a value in ``wanted`` (what it does anyway): mapped, nothing to set;
        any other value is refused. "auto" is the Trainer filling in its default, which is wanted[0]."""
        if self.peek(path) is None and None in wanted:   # JSON null: DeepSpeed's "not set", megalite's way
            self.matches(path, None, why)
            return None
        if self.peek(path) == AUTO:   # the Trainer fills in its default, which is megalite's way
            self.read.add(path)
            self.rows.append(Row(path, AUTO, MAPPED, note=f"the Trainer's default {_show(wanted[0])}: {why}"))
            return _MISSING
        value = self.take(path, kind)
        if value is not _MISSING and any(value == w and type(value) is type(w) for w in wanted):
            self.matches(path, value, why)
        elif value is not _MISSING:
            self.refuse(path, value, refusal)
        return value

    def ignores(self, prefix: str, table: dict[str, str]) -> None:
        """Every key of ``table`` (name -> why) given under ``prefix``: ignored, with why (whatever its value: an
        ignored value is never used)."""
        for name, why in table.items():
            if self.given(prefix + name):
                self.ignore(prefix + name, self.peek(prefix + name), why)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def current_value(self, key: str) -> Any:
        return get(self.current, key)

    def effective(self, key: str) -> Any:
        """The value ``key`` will have: the command line's if it sets it, else the file's so far, else megalite's."""
        if key not in self.user_keys:
            for row in reversed(self.rows):
                for k, value in reversed(row.settings):
                    if k == key:
                        return value
        return self.current_value(key)

    def refuse_unread(self, node: Optional[dict] = None, prefix: str = "") -> None:
        """Refuse every key no rule read: a whole unread block by its name, else its unread keys one by one. A
        top-level block saying ``"enabled": false`` asks for nothing: ignored."""
        for key, value in (self.data if node is None else node).items():
            path = prefix + key
            if path in self.read:
                continue
            if isinstance(value, dict) and not prefix and value.get("enabled") is False:
                self.ignore(path, value, "disabled: asks for nothing")
            elif isinstance(value, dict) and any(p.startswith(path + ".") for p in self.read):
                self.refuse_unread(value, path + ".")
            else:
                self.refuse(path, value)

    def finish(self) -> Translation:
        """The Translation, its table in the file's order (keys not given after the last key of their block)."""
        order: dict[str, int] = {}

        def walk(node: dict, prefix: str) -> None:
            for key, value in node.items():
                order[prefix + key] = len(order)
                if isinstance(value, dict):
                    walk(value, prefix + key + ".")
        walk(self.data, "")
        last = {path: max(i for p, i in order.items() if p == path or p.startswith(path + ".")) for path in order}

        def position(row: Row) -> float:
            if row.key in order and row.value is not _MISSING:
                return order[row.key]
            parts = row.key.split(".")
            for n in range(len(parts) - 1, 0, -1):   # after the last key of the nearest block the file gives
                parent = ".".join(parts[:n])
                if parent in last:
                    return last[parent] + 0.5
            return len(order)
        shown = sorted(range(len(self.rows)), key=lambda i: position(self.rows[i]))   # stable: reading order kept
        return Translation(self.name, self.rows, self.notes, self.user_keys, shown)


# --- rules, one per group of keys, in reading order ---------------------------------------------------------------

def _precision(r: _Reader) -> None:
    """bf16 / fp16 and the fp16 loss scaler (DeepSpeed's dynamic rule is megalite's: back off after ``hysteresis``
    overflowing steps, double after ``loss_scale_window`` clean ones, hysteresis reset when the scale grows)."""
    for name in ("bf16", "bfloat16"):   # DeepSpeed reads either spelling
        if r.block(name) is None:
            continue
        r.param(f"{name}.enabled", bool, "training.bf16", False)
        for key, why in [("bf16_master_weights_and_grads", "megalite keeps fp32 main parameters and gradients"),
                         ("bf16_optimizer_states", "megalite keeps fp32 Adam states")]:
            r.either(f"{name}.{key}", bool, (False,), why, why)
        r.either(f"{name}.immediate_grad_update", bool, (True,), "megalite adds each micro-batch's gradients into "
                 "fp32 buffers", "megalite accumulates gradients in fp32, not in bf16")
    if r.block("fp16") is None:
        return
    r.param("fp16.enabled", bool, "training.fp16", False)
    params = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
              "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads")
    if not r.effective("training.fp16"):   # DeepSpeed ignores the scaler's parameters too
        for p in params:
            if r.given(f"fp16.{p}"):
                r.ignore(f"fp16.{p}", r.peek(f"fp16.{p}"), "not used: fp16 is off (in DeepSpeed too)")
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
        r.either(f"fp16.{key}", bool, (False,), why, why)


_SCHEDULES_SETTING_LR = ("WarmupLR", "WarmupDecayLR")   # their warmup_max_lr, not the optimizer's lr, is the peak


def _optimizer(r: _Reader) -> None:
    """Adam/AdamW onto megalite's AdamW; omitted parameters take the defaults of DeepSpeed's Adam (lr 1e-3, betas
    (0.9, 0.999), eps 1e-8, weight decay 0). Muon onto --optimizer muon as DeepSpeed's Muon updates (Keller Jordan's
    muon_update: Nesterov, 5 Newton-Schulz steps, the update scaled by sqrt(max(1, rows/cols))), its momentum
    (default 0.95) mapped, its auxiliary Adam read as above. Also gradient clipping."""
    _clipping(r)
    if r.block("optimizer") is None:
        return
    if r.peek("optimizer.type") is _MISSING:
        raise ConfigError(f"--deepspeed-config {r.name}: optimizer needs a type (Adam or AdamW)")
    if r.peek("optimizer.type") == AUTO:   # the Trainer's default optimizer, AdamW
        r.matches("optimizer.type", AUTO, "the Trainer's AdamW, megalite's optimizer")
        kind = "adamw"
    else:
        kind = r.take("optimizer.type", str)
        kind = kind.lower()   # DeepSpeed compares the names in lower case
        if kind not in ("adam", "adamw", "muon"):
            r.refuse("optimizer.type", r.peek("optimizer.type"), "megalite's optimizers are AdamW and Muon")
            r.read.add("optimizer.params")
            return
        if kind == "muon":
            _muon(r)
            kind = "adamw"   # the rest: its auxiliary Adam, decoupled (DeepSpeed's adam_update with lr x wd)
        else:
                r.matches("optimizer.type", r.peek("optimizer.type"), "megalite's optimizer is AdamW" + (
                " (DeepSpeed's Adam is AdamW unless adam_w_mode is false)" if kind == "adam" else ""))
    p = "optimizer.params"
    r.block(p)
    adam_w_mode = r.take(f"{p}.adam_w_mode", bool)
    if adam_w_mode is False and kind == "adam":   # "AdamW" is decoupled whatever adam_w_mode says
        r.refuse(f"{p}.adam_w_mode", False, "Adam with L2 regularization; megalite's is AdamW")
    elif adam_w_mode is not _MISSING:
        r.matches(f"{p}.adam_w_mode", adam_w_mode, "decoupled weight decay, as megalite's AdamW")
    if r.given(f"{p}.torch_adam"):
        r.ignore(f"{p}.torch_adam", r.check(f"{p}.torch_adam", r.peek(f"{p}.torch_adam"), bool),
                 "torch's Adam or DeepSpeed's fused one: the same update, at another speed")
    for key, wanted in [("bias_correction", True), ("amsgrad", False)]:
        r.either(f"{p}.{key}", bool, (wanted,), "as megalite's AdamW", "megalite's AdamW does not do that")
    schedule = r.peek("scheduler.type")
    if schedule in _SCHEDULES_SETTING_LR and r.given(f"{p}.lr"):
        lr = r.peek(f"{p}.lr")
        r.ignore(f"{p}.lr", lr if lr == AUTO else r.check(f"{p}.lr", lr, float),
                 f"not used: DeepSpeed's {schedule} sets the learning rate from its warmup_max_lr (in DeepSpeed too)")
    elif schedule not in _SCHEDULES_SETTING_LR:
        r.param(f"{p}.lr", float, "optimizer.lr", 1e-3)
    betas = r.take(f"{p}.betas", list, keeps=("optimizer.adam_beta1", "optimizer.adam_beta2"))
    if betas is not _MISSING:
        if len(betas) != 2:
            raise ConfigError(f"--deepspeed-config {r.name}: {p}.betas must be [beta1, beta2], got {_show(betas)}")
        b1, b2 = (r.check(f"{p}.betas", b, float) for b in betas)
        r.map(f"{p}.betas", betas, {"optimizer.adam_beta1": b1, "optimizer.adam_beta2": b2})
    elif not r.given(f"{p}.betas"):
        r.map_default(f"{p}.betas", [0.9, 0.999], "optimizer.adam_beta1", 0.9)
        r.map_default(f"{p}.betas", [0.9, 0.999], "optimizer.adam_beta2", 0.999)
    r.param(f"{p}.eps", float, "optimizer.adam_eps", 1e-8)
    decay = r.peek(f"{p}.weight_decay")   # DeepSpeed decays what the script's parameter groups say, often all
    r.param(f"{p}.weight_decay", float, "optimizer.weight_decay", 0.0,
            note="megalite does not decay biases and norm weights" if decay not in (_MISSING, AUTO, 0) else "")


def _muon(r: _Reader) -> None:
    """DeepSpeed's Muon (the hidden 2-D weights; AdamW for the rest, as megalite's split) at one learning rate."""
    r.map("optimizer.type", r.peek("optimizer.type"),
          {"optimizer.optimizer": "muon", "optimizer.muon_use_nesterov": True, "optimizer.muon_num_ns_steps": 5,
           "optimizer.muon_scale_mode": "shape_scaling", "optimizer.muon_extra_scale_factor": 1.0},
          "DeepSpeed's Muon update: Nesterov, 5 Newton-Schulz steps, scaled by sqrt(max(1, rows/cols))")
    p = "optimizer.params"
    r.block(p)
    r.param(f"{p}.momentum", float, "optimizer.muon_momentum", 0.95)
    lr = r.peek(f"{p}.lr")
    for key in ("muon_lr", "adam_lr"):
        value = r.peek(f"{p}.{key}")
        if value is _MISSING or value == AUTO:
            continue
        if lr not in (_MISSING, AUTO) and value == lr:
            r.matches(f"{p}.{key}", value, "the same as lr")
        else:
            r.refuse(f"{p}.{key}", value, "megalite steps the Muon and AdamW parameters at one learning rate, lr")


def _clipping(r: _Reader) -> None:
    clip = r.take("gradient_clipping", float, keeps=("optimizer.clip_grad",))
    if clip is not _MISSING:
        if clip < 0:
            raise ConfigError(f"--deepspeed-config {r.name}: gradient_clipping must be >= 0, got {_show(clip)}")
        r.map("gradient_clipping", clip, {"optimizer.clip_grad": clip}, "0: no clipping" if clip == 0 else "")
    elif not r.given("gradient_clipping") and r.effective("optimizer.clip_grad") != 0:
        r.note(f"gradient_clipping not given: megalite clips at --clip-grad {_show(r.effective('optimizer.clip_grad'))}"
               f" (DeepSpeed would not clip; give 0 to match it)")


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
    if warmup_type == "linear":
        r.matches(f"{p}.warmup_type", warmup_type, "megalite's warm-up is linear")
    elif warmup_type is not _MISSING:
        why = "megalite's warm-up is linear"
        if not r.given(f"{p}.warmup_type"):
            why = "not given: DeepSpeed's default is log; " + why + ', give "linear"'
        r.refuse(f"{p}.warmup_type", warmup_type, why)
    r.either(f"{p}.last_batch_iteration", int, (-1,), "a fresh schedule",
             "megalite resumes the schedule from its checkpoints")
    start_name = "warmup_min_ratio" if kind == "WarmupCosineLR" else "warmup_min_lr"
    r.either(f"{p}.{start_name}", float, (0, 0.0), "megalite warms up from 0", "megalite warms up from 0")
    steps = r.take(f"{p}.warmup_num_steps", int, default=1000, keeps=("optimizer.lr_warmup_iters",))
    if steps is not _MISSING:
        warmup = max(2, steps)   # DeepSpeed's own floor
        note = "DeepSpeed warms up over at least 2 steps" if warmup != steps else ""
        if not r.given(f"{p}.warmup_num_steps"):
            r.rows.append(Row(f"{p}.warmup_num_steps", _MISSING, MAPPED, (("optimizer.lr_warmup_iters", warmup),),
                              note="not given: DeepSpeed's default 1000"))
        else:
            r.map(f"{p}.warmup_num_steps", steps, {"optimizer.lr_warmup_iters": warmup}, note)
    if kind in _SCHEDULES_SETTING_LR:
        r.param(f"{p}.warmup_max_lr", float, "optimizer.lr", 1e-3)
    if kind == "WarmupLR":
        r.map("scheduler.type", kind, {"optimizer.lr_decay_style": "constant"})
        return
    total = r.take(f"{p}.total_num_steps", int, keeps=("optimizer.lr_decay_iters",))
    if not r.given(f"{p}.total_num_steps"):
        raise ConfigError(f"--deepspeed-config {r.name}: {kind} needs {p}.total_num_steps (DeepSpeed requires it "
                          f"too; \"auto\" keeps megalite's --lr-decay-iters)")
    if total is not _MISSING:
        r.map(f"{p}.total_num_steps", total, {"optimizer.lr_decay_iters": total})
    if kind == "WarmupDecayLR":
        r.map("scheduler.type", kind, {"optimizer.lr_decay_style": "linear", "optimizer.min_lr": 0.0},
              "decays to warmup_min_lr, 0")
        return
    ratio = r.take(f"{p}.cos_min_ratio", float, default=1e-4)
    settings = {"optimizer.lr_decay_style": "cosine"}
    note = ""
    if ratio is not _MISSING:   # a ratio of the lr the run will have, the command line's --lr included
        lr = r.effective("optimizer.lr")
        settings["optimizer.min_lr"] = ratio * lr
        note = f"min lr = cos_min_ratio {_show(ratio)} x lr {_show(lr)}"
        if not r.given(f"{p}.cos_min_ratio"):
            note += ", cos_min_ratio not given: DeepSpeed's default"
    r.map("scheduler.type", kind, settings, note)


# zero_optimization keys that only tune DeepSpeed's speed or memory, with no megalite counterpart: name -> why.
# DeepSpeed also accepts the stage-3 ones by their field names (max_live_parameters, ...): both spellings are here.
_FSDP2 = "FSDP2 gathers each layer's parameters for its forward and again for its backward, and frees them after each"
_PERSISTENCE = "FSDP2 shards every parameter, small ones too: latency only"
_GRANULARITY = "megalite's FSDP2 units are whole transformer layers"
_GATHER = "how parameters are gathered: communication only"
_INIT = "DeepSpeed's memory while it partitions the model; FSDP2 shards each parameter as the model is built"
_SAVE_16BIT = ("megalite saves DCP checkpoints, each tensor gathered whole; tools/convert_checkpoint.py export-hf "
               "writes the full weights")
_ZERO_SPEED_OR_MEMORY = {
    "contiguous_gradients": "megalite's gradients live in contiguous buckets (FSDP2: flat shards) anyway",
    "reduce_scatter": "megalite reduce-scatters at stages 1-2 and all-reduces at stage 0: the same sums",
    "allgather_partitions": "all-gather or a series of broadcasts: the same parameters",
    "use_multi_rank_bucket_allreduce": "how small buckets are combined: communication only",
    "round_robin_gradients": "the order gradients are copied to the host: speed only",
    "compute_grad_norm": "megalite always computes the gradient norm (it logs it)",
    "parameter_alignment": "padding between parameters in flat buffers: memory only",
    "elastic_checkpoint": "megalite's checkpoints load at any layout anyway",
    "ignore_unused_parameters": "megalite's GPT uses every parameter",
    "legacy_stage1": "DeepSpeed's old stage-1 code: the same optimizer sharding",
    "cpu_offload_use_pin_memory": "page-locked host buffers: copy speed only",
    "sub_group_size": "megalite steps a rank's whole shard at once: DeepSpeed's optimizer tiles change its temporary "
                      "memory only",
    "stage3_max_live_parameters": f"{_FSDP2}: a few layers live at most",
    "max_live_parameters": f"{_FSDP2}: a few layers live at most",
    "stage3_max_reuse_distance": _FSDP2,
    "max_reuse_distance": _FSDP2,
    "stage3_param_persistence_threshold": _PERSISTENCE,
    "param_persistence_threshold": _PERSISTENCE,
    "stage3_model_persistence_threshold": _PERSISTENCE,
    "model_persistence_threshold": _PERSISTENCE,
    "stage3_module_granularity_threshold": _GRANULARITY,
    "module_granularity_threshold": _GRANULARITY,
    "leaf_module": _GRANULARITY,
    "stage3_use_all_reduce_for_fetch_params": _GATHER,
    "use_all_reduce_for_fetch_params": _GATHER,
    "stage3_allgather_sequential": _GATHER,
    "allgather_sequential": _GATHER,
    "mics_hierarchical_params_gather": _GATHER,
    "stage3_partition_stream_chunk_size": _INIT,
    "partition_stream_chunk_size": _INIT,
    "stage3_gather_16bit_weights_on_model_save": _SAVE_16BIT,
    "gather_16bit_weights_on_model_save": _SAVE_16BIT,
    "stage3_gather_fp16_weights_on_model_save": _SAVE_16BIT,
    "zero_hpz_partition_size": "ZeRO++'s second, intra-node copy of the parameters, for faster gathers: megalite "
                               "gathers over the whole data-parallel group (less memory, more traffic)",
    "zeropp_loco_param": "only used with zero_quantized_gradients",
    "memory_efficient_linear": "DeepSpeed's memory-saving stage-3 linear layer; megalite's layers are its own",
    "pipeline_loading_checkpoint": "how DeepSpeed loads stage-3 checkpoints",
    "override_module_apply": "DeepSpeed's stage-3 module hooks",
    "enable_sanity_checks": "DeepSpeed's internal checks",
    "log_trace_cache_warnings": "DeepSpeed's stage-3 trace cache",
    "save_muon_momentum_buffer_in_memory": "Muon with NVMe offload only",
}
# keys of offload_optimizer / offload_param that only tune speed or memory
_OFFLOAD_SPEED_OR_MEMORY = {
    "pin_memory": "page-locked host buffers: copy speed only",
    **{name: "NVMe only" for name in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read",
                                      "pipeline_write", "fast_init")},
    "super_offload": "DeepSpeed's CPU-offload speed-up for superchips",
    "convert_grad_on_cpu": "where gradients are cast: speed only",
    "cpuadam_cores_perc": "the share of cores DeepSpeed's CPU Adam uses; megalite's uses torch's threads",
}
_FSDP2_OVERLAPS = "FSDP2 (ZeRO-3) overlaps its gathers and reductions with compute whatever this says"
_FSDP2_LAYERS = "FSDP2 (ZeRO-3) gathers and reduce-scatters layer by layer"


def _zero(r: _Reader) -> None:
    """ZeRO stage and offload, and every other ``zero_optimization`` key DeepSpeed documents or reads. Stage 0 is
    plain data parallelism, 1-2 megalite's distributed optimizer, 3 FSDP2; the other keys are read at the stage the
    run will have (the command line's --zero-stage included)."""
    z = "zero_optimization"
    if isinstance(r.peek(z), bool):   # DeepSpeed's first format: "zero_optimization": true is stage 1
        _zero_stage(r, z, 1 if r.peek(z) else 0, "the old format: true is stage 1, false 0")
        r.ignores("", {"allgather_size": "the old format's allgather_bucket_size: megalite gathers parameters in its "
                                         "gradient buckets"})
        return
    r.ignores("", {"allgather_size": "only read with the old format, \"zero_optimization\": true"})
    if r.block(z) is None:
        return
    stage = r.take(f"{z}.stage", int, default=0,
                   keeps=("optimizer.use_distributed_optimizer", "optimizer.zero_stage"))
    if stage is not _MISSING and stage not in (0, 1, 2, 3):
        raise ConfigError(f"--deepspeed-config {r.name}: {z}.stage must be 0, 1, 2 or 3, got {stage}")
    if stage is not _MISSING:
        _zero_stage(r, f"{z}.stage", stage, "" if r.given(f"{z}.stage") else "not given: DeepSpeed's default 0")
    level = OptimizerConfig(use_distributed_optimizer=r.effective("optimizer.use_distributed_optimizer"),
                            zero_stage=r.effective("optimizer.zero_stage")).zero_level
    _offload(r, z)
    if level == 3:
        r.ignores(f"{z}.", {"overlap_comm": _FSDP2_OVERLAPS, "reduce_bucket_size": _FSDP2_LAYERS,
                            "allgather_bucket_size": _FSDP2_LAYERS})
        r.param(f"{z}.stage3_prefetch_bucket_size", int, "optimizer.zero3_prefetch_bucket_size")
        r.param(f"{z}.prefetch_bucket_size", int, "optimizer.zero3_prefetch_bucket_size")
    else:
        r.param(f"{z}.overlap_comm", bool, "optimizer.overlap_grad_reduce")
        r.param(f"{z}.reduce_bucket_size", int, "optimizer.ddp_bucket_size")
        r.ignores(f"{z}.", {"allgather_bucket_size": "not used at stage 0 (in DeepSpeed too)" if level == 0 else
                            "megalite gathers parameters in its gradient buckets (reduce_bucket_size)",
                            "stage3_prefetch_bucket_size": "not used below stage 3 (in DeepSpeed too)",
                            "prefetch_bucket_size": "not used below stage 3 (in DeepSpeed too)"})
    r.ignores(f"{z}.", _ZERO_SPEED_OR_MEMORY)
    _mics(r, f"{z}.mics_shard_size", level)
    r.either(f"{z}.load_from_fp32_weights", bool, (True,), "megalite's checkpoints keep the fp32 main parameters",
             "megalite restores the fp32 main parameters of its checkpoints, never rounds them from 16-bit weights")
    for key, what in [("zero_quantized_weights", "weights"), ("zero_quantized_gradients", "gradients"),
                      ("zero_quantized_nontrainable_weights", "frozen weights")]:
        r.either(f"{z}.{key}", bool, (False,), "full-precision communication, as megalite's",
                 f"ZeRO++'s quantized {what} change the values trained on")
    if r.given(f"{z}.zenflow"):
        r.refuse(f"{z}.zenflow", why="ZenFlow applies unimportant gradients late: different steps")


def _mics(r: _Reader, key: str, level: int) -> None:
    """MiCS (``mics_shard_size`` S, DeepSpeed's stage 3 only): shard over groups of S ranks, replicated across them,
    which is HSDP: --num-distributed-optimizer-instances DP x CP / S. -1, DeepSpeed's default, turns it off."""
    size = r.take(key, int, keeps=("parallel.num_distributed_optimizer_instances",))
    if size is _MISSING:
        return
    if size == -1 or size == 0:
        r.matches(key, size, "MiCS off: shards over the whole data-parallel group, as megalite does")
        return
    if level != 3:
        r.ignore(key, size, "MiCS applies at stage 3 only (in DeepSpeed too)")
        return
    try:
        dims = ParallelDims.of(r.current.parallel, r.world_size)
    except ConfigError as error:
        raise ConfigError(f"--deepspeed-config {r.name}: {key} needs the data-parallel size, but {error}") from None
    if size < 1 or dims.dp_cp % size:
        raise ConfigError(f"--deepspeed-config {r.name}: {key} {size} does not divide the data-parallel x "
                          f"context-parallel size {dims.dp_cp}")
    r.map(key, size, {"parallel.num_distributed_optimizer_instances": dims.dp_cp // size},
          f"HSDP: {dims.dp_cp // size} instances of {size} ranks")


def _zero_stage(r: _Reader, key: str, stage: int, note: str) -> None:
    wanted = {f"optimizer.{name}": value for name, value in OptimizerConfig.zero_settings(stage).items()}
    # The option that names the stage, and the other only where it does not hold already: "--zero-stage 3", not also
    # "optimizer.use_distributed_optimizer=false".
    main = {0: ("optimizer.use_distributed_optimizer",), 3: ("optimizer.zero_stage",)}.get(stage, tuple(wanted))
    settings = {k: value for k, value in wanted.items() if k in main or r.effective(k) != value}
    r.read.add(key)
    r.rows.append(Row(key, r.peek(key), MAPPED, tuple(settings.items()), note=note))


def _offload(r: _Reader, z: str) -> None:
    """offload_optimizer / offload_param and their deprecated booleans (cpu_offload, cpu_offload_param).
    offload_param below stage 3 is validate()'s to refuse: --offload-params needs --zero-stage 3."""
    for block, legacy, setting in [("offload_optimizer", "cpu_offload", "optimizer.optimizer_cpu_offload"),
                                   ("offload_param", "cpu_offload_param", "optimizer.offload_params")]:
        path = f"{z}.{block}"
        if r.given(path) and r.given(f"{z}.{legacy}"):   # DeepSpeed refuses both as well
            raise ConfigError(f"--deepspeed-config {r.name}: give {path} or the deprecated {z}.{legacy}, not both")
        if r.given(f"{z}.{legacy}"):
            r.param(f"{z}.{legacy}", bool, setting, note=f"the deprecated spelling of {block}.device cpu")
            continue
        if r.peek(path) is None:   # null: DeepSpeed's "no offload"
            r.matches(path, None, "nothing offloaded")
            continue
        if r.block(path) is None:
            continue
        device = r.take(f"{path}.device", str, default="none", keeps=(setting,))
        if device == "nvme":
            r.refuse(f"{path}.device", device, "NVMe offload")
        elif device in ("cpu", "none"):
            if r.given(f"{path}.device"):
                r.map(f"{path}.device", device, {setting: device == "cpu"})
            else:
                r.map_default(f"{path}.device", "none", setting, False)
        elif device is not _MISSING:
            raise ConfigError(f"--deepspeed-config {r.name}: {path}.device must be cpu, nvme or none, got "
                              f"{_show(device)}")
        r.ignores(f"{path}.", _OFFLOAD_SPEED_OR_MEMORY)
        ratio = r.take(f"{path}.ratio", float)
        if ratio == 1:
            r.matches(f"{path}.ratio", ratio, "all of it offloaded")
        elif ratio is not _MISSING:
            r.ignore(f"{path}.ratio", ratio, "megalite offloads all of the optimizer or none: the same step, with "
                                             "less device memory and more host work")


def _batch(r: _Reader) -> None:
    """train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size, which is
    world / (TP x CP x PP) (:class:`ParallelDims`): CP ranks split one replica's samples, as DeepSpeed's
    sequence-parallel ranks do, which its data-parallel size leaves out too.

    DeepSpeed's resolution (runtime/config.py): any two of the three give the third (by integer division); the
    batch size alone means gradient accumulation 1 and micro-batch batch / DP; the micro-batch alone means
    accumulation 1 and batch micro x DP; all three must agree. megalite has only the global and micro-batch sizes
    (accumulation is their quotient over DP), so the command line's --global-batch-size / --micro-batch-size (or
    their Hydra keys) are put in place of the file's values before the resolution, and gradient_accumulation_steps
    gives way when that leaves the three disagreeing. A size left "auto" is megalite's own (the Trainer fills it from
    its own batch arguments), as if given on the command line.
    """
    names = {"train_batch_size": "training.global_batch_size",
             "train_micro_batch_size_per_gpu": "training.micro_batch_size",
             "gradient_accumulation_steps": None}
    autos = [name for name in names if r.peek(name) == AUTO]
    r.read.update(autos)   # their rows come below, once the sizes are known
    file = {name: r.take(name, int) for name in names if name not in autos}
    file = {name: value for name, value in file.items() if value is not _MISSING}
    for name, value in file.items():
        if value < 1:
            raise ConfigError(f"--deepspeed-config {r.name}: {name} must be >= 1, got {value}")
    user = {name: r.current_value(key) for name, key in names.items() if key in r.user_keys}
    kept = {name: r.current_value(names[name]) for name in autos if names[name] and name not in user}
    if not file and not autos:
        return
    try:
        dims = ParallelDims.of(r.current.parallel, r.world_size)
    except ConfigError as error:
        raise ConfigError(f"--deepspeed-config {r.name}: its batch sizes need the data-parallel size, but {error}") \
            from None
    dp = dims.dp
    values = {**kept, **file, **user}
    source = {name: ("command line" if name in user else "auto" if name in kept else "file") for name in values}
    t, m, g = (values.get(name) for name in names)
    gives_way = False
    if t is not None and m is not None and g is not None and (user or kept) and t != m * g * dp:
        gives_way, g = True, None
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
                          f"size {r.world_size} / (TP {dims.tp} x CP {dims.cp} x PP {dims.pp}))")
    # The file's own values are mapped even where the command line overrides them, so the table can say so.
    how = f"derived by DeepSpeed's rule at data-parallel size {dp}"
    accumulation = f"megalite accumulates global / (micro x data-parallel size) = {g} micro-batches"
    for name, value in (("train_batch_size", t), ("train_micro_batch_size_per_gpu", m)):
        if name in file:
            r.map(name, file[name], {names[name]: file[name]})
        elif name in autos:
            r.keep(name, names[name])
        elif name == derived:
            r.rows.append(Row(name, _MISSING, MAPPED, ((names[name], value),), note=how))
    ga = "gradient_accumulation_steps"
    if ga in autos:
        r.rows.append(Row(ga, AUTO, MAPPED, note=accumulation))
    elif ga in file:
        gives = f"gives way to the {'command line' if user else 'auto'} batch sizes: " if gives_way else ""
        r.matches(ga, file[ga], gives + accumulation)
    elif derived == ga:
        r.rows.append(Row(ga, _MISSING, MAPPED, note=f"{how}: {accumulation}"))


def _origin(source: dict, name: str, derived: str) -> str:
    """Where a value of the batch arithmetic came from, for the error message ('' for the file itself)."""
    if name == derived:
        return "(derived) "
    return {"command line": "(from the command line) ", "auto": "(auto: megalite's) "}.get(source.get(name), "")


_RECOMPUTE_FULL = {"model.recompute_granularity": "full", "model.recompute_method": "uniform",
                   "model.recompute_num_layers": 1}


def _recompute(r: _Reader) -> None:
    """activation_checkpointing -> full recompute of every layer.

    In DeepSpeed the block says how the layers the training script checkpoints are checkpointed; the scripts people
    pair it with checkpoint every transformer layer (Megatron-DeepSpeed's --checkpoint-activations, the Trainer's
    gradient_checkpointing). megalite does that with --recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1; recomputing gives the same results, with less activation memory.
    """
    a = "activation_checkpointing"
    if r.block(a) is None:
        return
    r.read.add(a + ".")   # a marker: refuse_unread looks inside the block for keys the lines below did not read
    # A --recompute-granularity other than full on the command line wins: then the file sets no method to go with it.
    full = "model.recompute_granularity" not in r.user_keys or r.current.model.recompute_granularity == "full"
    r.map(a, r.peek(a), _RECOMPUTE_FULL if full else {"model.recompute_granularity": "full"},
          "every layer, as the training scripts that use DeepSpeed's checkpointing do")
    partition = r.take(f"{a}.partition_activations", bool)
    tp = r.current.parallel.tensor_model_parallel_size
    if partition is True and tp > 1:
        r.map(f"{a}.partition_activations", True, {"parallel.sequence_parallel": True},
              "sequence parallelism keeps each recomputed layer's input split over the TP ranks, as partitioning "
              "does; it also runs norms and dropout on sequence shards: the same math, less memory")
    elif partition is True:
        r.ignore(f"{a}.partition_activations", True, "tensor-parallel size 1: nothing to partition over (in "
                                                    "DeepSpeed too)")
    elif partition is False:
        r.matches(f"{a}.partition_activations", False, "each rank keeps whole layer inputs")
    r.ignores(f"{a}.", {
        "cpu_checkpointing": "megalite keeps the recomputed layers' inputs on the device (more device memory, no "
                             "copies)",
        "contiguous_memory_optimization": "where the checkpoints are stored: memory layout only",
        "number_checkpoints": "sizes DeepSpeed's contiguous checkpoint buffer",
        "synchronize_checkpoint_boundary": "a device synchronization: speed only",
        "profile": "DeepSpeed's per-checkpoint timing; --timing-log-level 1 times forward-backward",
    })


def _monitoring(r: _Reader) -> None:
    """Logging, timers and TensorBoard; the monitors megalite does not have are refused when enabled."""
    r.param("steps_per_print", int, "logging.log_interval")
    breakdown = r.take("wall_clock_breakdown", bool, keeps=("logging.timing_log_level",))
    if breakdown is not _MISSING:   # forward/backward, reduction and step times, as DeepSpeed's breakdown
        r.map("wall_clock_breakdown", breakdown, {"logging.timing_log_level": 1 if breakdown else 0},
              "forward-backward, gradient reduction and optimizer step times" if breakdown else "")
    if r.block("tensorboard") is not None:
        enabled = r.take("tensorboard.enabled", bool, default=False, keeps=("logging.tensorboard_dir",))
        output = r.take("tensorboard.output_path", str, default="")
        job = r.take("tensorboard.job_name", str, default="DeepSpeedJobName")
        if enabled is True:   # DeepSpeed's log directory: output_path/job_name
            directory = os.path.join(output or "", job or "DeepSpeedJobName")
            r.map("tensorboard", r.peek("tensorboard"), {"logging.tensorboard_dir": directory},
                  "megalite's scalars (loss, lr, grad_norm, ...) by iteration, not DeepSpeed's Train/Samples/* by "
                  "sample")
        elif enabled is False:
            r.ignore("tensorboard", r.peek("tensorboard"), "disabled: asks for nothing")
    for name, why in [("wandb", "no Weights & Biases logging in megalite: use --tensorboard-dir or --metrics-file"),
                      ("comet", "no Comet logging in megalite: use --tensorboard-dir or --metrics-file"),
                      ("csv_monitor", "no CSV monitor in megalite: --metrics-file writes JSON lines"),
                      ("comms_logger", "no communication log in megalite: --timing-log-level 1 times the reductions"),
                      ("flops_profiler", "no per-module profile in megalite: it logs TFLOP/s and MFU itself")]:
        block = r.block(name)
        if block is not None and block.get("enabled", False) in (False, AUTO):   # DeepSpeed's default: off
            r.ignore(name, block, "disabled: asks for nothing")
        elif block is not None:
            r.refuse(name, block, why)
    r.ignores("", {
        "dump_state": "megalite prints its layout and parameter count at the start anyway",
        "memory_breakdown": "megalite logs the peak device memory every logged iteration",
        "disable_python_gc": "Python's garbage collector: speed only",
        "zero_allow_untested_optimizer": "a permission; megalite's optimizer is its own AdamW",
        "zero_force_ds_cpu_optimizer": "a permission; megalite's CPU optimizer is its own",
        "sparse_gradients": "sparse reduction of sparse embedding gradients: communication only (megalite's are "
                            "dense)",
        "aio": "tunes NVMe I/O; megalite offloads to the CPU only",
    })


def _checkpointing(r: _Reader) -> None:
    """DeepSpeed's checkpoint block: megalite's DCP checkpoints load at any layout and are checked before use."""
    c = "checkpoint"
    if r.block(c) is None:
        return
    r.ignores(f"{c}.", {
        "tag_validation": "megalite checks a checkpoint's files before loading it",
        "load_universal": "megalite's checkpoints load at any layout anyway",
        "parallel_write": "how DeepSpeed spreads the writing: speed only",
    })
    r.either(f"{c}.use_node_local_storage", bool, (False,), "one checkpoint directory every rank reads",
             "a megalite checkpoint is one directory every rank reads")


def _communication(r: _Reader) -> None:
    """Gradient reduction and precision keys: what megalite does is accepted, anything that changes the values
    trained on is refused."""
    divided = "megalite divides gradients once, after reducing them in fp32"
    r.either("prescale_gradients", bool, (False,), divided, divided)
    r.either("gradient_predivide_factor", float, (1, 1.0), divided, divided)
    r.either("gradient_allreduce_op", str, ("mean",), "megalite's loss is the mean over the global batch",
             "megalite's loss is the mean over the global batch")
    r.either("communication_data_type", str, ("fp32", None), "megalite reduces gradients in fp32",
             "megalite reduces gradients in fp32")
    if r.block("data_types") is not None:
        r.either("data_types.grad_accum_dtype", str, ("fp32", None), "megalite accumulates gradients in fp32",
                 "megalite accumulates gradients in fp32")
    for name, why in [("amp", "NVIDIA apex's AMP; megalite's --bf16 / --fp16 keep fp32 main parameters"),
                      ("torch_autocast", "autocast over fp32 parameters; megalite's --bf16 / --fp16 cast the "
                                         "parameters and keep fp32 main copies")]:
        block = r.block(name)
        if block is None:
            continue
        enabled = block.get("enabled", False)
        if enabled in (False, AUTO):   # "auto": the Trainer enables apex AMP only with --fp16_backend apex
            r.ignore(name, block, "off" + (" unless the Trainer runs apex (--fp16_backend apex)"
                                           if enabled == AUTO else ""))
        else:
            r.refuse(name, block, why)


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


def _shown_value(value: Any) -> str:
    """A value in the table: a block as {...}."""
    return "{...}" if isinstance(value, dict) else _show(value)


def _shown_setting(key: str, value: Any) -> str:
    """A megalite setting as the command line says it; an unset one as its flag with megalite's default."""
    if value is None:
        return f"{BY_KEY[key].flag} unset"
    return " ".join(argv({key: value}))
