"""The one place that spells an option: its flag (the field name with dashes: ``--tensor-model-parallel-size``), its
Hydra key (section and field: ``parallel.tensor_model_parallel_size``) and value, the composition of configs/, and a
config turned back into a command line. A string field marked ``nargs="+"`` takes several words as in Megatron
(``--data-path 0.3 A 0.7 B``). Hydra and OmegaConf are imported only inside the functions that need them, so
importing this module (and megalite.config) leaves them unloaded: training never needs them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, Iterable, Optional

from megalite.config.schema import ConfigError, MegaliteConfig, multi_word_values, sections

SCHEMA_NAME = "megalite_schema"  # referenced by the defaults list of configs/config.yaml
CONFIG_DIR_ENV = "MEGALITE_CONFIG_DIR"

# Types a field may have, mapped to the converter of its flag's value (None: a switch, no value).
CONVERTERS = {int: int, float: float, str: str, bool: None, Optional[int]: int, Optional[float]: float,
              Optional[str]: str}


@dataclasses.dataclass(frozen=True)
class Flag:
    """One Megatron flag and the dataclass field it sets."""
    flag: str                  # "--tensor-model-parallel-size"
    section: str               # "parallel"
    name: str                  # "tensor_model_parallel_size"
    type: Any                  # the field's annotation, e.g. int or Optional[int]
    default: Any
    help: str
    multi_word: bool = False   # takes one or more words (Megatron's nargs="+"), joined by spaces into the string
    metavar: Optional[str] = None

    @property
    def key(self) -> str:
        """The Hydra key: ``section.field_name``."""
        return f"{self.section}.{self.name}"

    @property
    def is_switch(self) -> bool:
        return self.type is bool


def _build_flag_table() -> list[Flag]:
    """One Flag per dataclass field, in declaration order; raises if two fields would share a flag."""
    table: list[Flag] = []
    seen = {"--help": "argparse"}  # -h/--help is argparse's own
    for section, cls in sections():
        hints = typing.get_type_hints(cls)  # resolves the string annotations of `from __future__ import annotations`
        for field in dataclasses.fields(cls):
            flag, key = "--" + field.name.replace("_", "-"), f"{section}.{field.name}"
            if flag in seen:
                raise RuntimeError(f"{key} and {seen[flag]} would both be the flag {flag}; rename one field")
            seen[flag] = key
            ftype = hints[field.name]
            if ftype not in CONVERTERS:
                raise RuntimeError(f"{key}: type {ftype} has no flag support")
            if ftype is bool and field.default is not False:
                # A switch can only turn an option on; a True default would need a --no-x pair, which we avoid.
                raise RuntimeError(f"{key}: bool options must default to False")
            if not field.metadata.get("help"):
                raise RuntimeError(f"{key} has no help text")
            multi_word = field.metadata.get("nargs") == "+"
            if multi_word and ftype not in (str, Optional[str]):
                raise RuntimeError(f"{key}: only string options may take several words")
            table.append(Flag(flag, section, field.name, ftype, field.default, field.metadata["help"], multi_word,
                              field.metadata.get("metavar")))
    return table


FLAGS = _build_flag_table()  # checked at import, so a clash fails loudly before any run
BY_KEY = {f.key: f for f in FLAGS}
_BY_FIELD = {f.name: f for f in FLAGS}


class _FlagNames:
    """``FLAG.num_layers`` is ``"--num-layers"``: an option's flag for messages, checked against the schema (field
    names are unique over all sections, which the flag table enforces)."""

    def __getattr__(self, field_name: str) -> str:
        try:
            return _BY_FIELD[field_name].flag
        except KeyError:
            raise AttributeError(f"no option named {field_name!r}") from None


FLAG = _FlagNames()


# ---- values on a command line -----------------------------------------------------------------------------------

def hydra_value(value: Any) -> str:
    """A Python value as the right-hand side of a Hydra override, read back as exactly that value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr round-trips floats; inf and nan are valid Hydra literals too
    from hydra.core.override_parser.types import Quote, QuotedString   # noqa: PLC0415 - Hydra only when quoting

    # Strings are always quoted (so "1", "true", "a,b" or "x=y" stay strings), and "${" is escaped so OmegaConf does
    # not resolve it as an interpolation; backslashes just before it are doubled, as OmegaConf unescapes them.
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", str(value))
    return QuotedString(text=text, quote=Quote.single).with_quotes()


def override(key: str, value: Any) -> str:
    """``section.field=value`` as Hydra reads it."""
    return f"{key}={hydra_value(value)}"


def argv(settings: dict[str, Any]) -> list[str]:
    """Settings (``section.field`` -> value) as command-line words: ``--zero-stage 3``, ``--bf16``, and the Hydra
    override where no flag can say it (a switch turned off, an option reset to None)."""
    words: list[str] = []
    for key, value in settings.items():
        flag = BY_KEY[key]
        if flag.is_switch and value is True:
            words.append(flag.flag)
        elif value is None or isinstance(value, bool):
            words.append(override(key, value))
        elif flag.multi_word:   # one word per value word, so that it reads back the same (quoted words stay one)
            words += [flag.flag, *multi_word_values(str(value))]
        else:
            words += [flag.flag, str(value)]
    return words


def differences(cfg: MegaliteConfig, base: MegaliteConfig, keys: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """The settings (``section.field`` -> value, schema order) where ``cfg`` differs from ``base``, among ``keys``
    (default: every option)."""
    wanted = None if keys is None else set(keys)
    return {f.key: get(cfg, f.key) for f in FLAGS
            if (wanted is None or f.key in wanted) and get(cfg, f.key) != get(base, f.key)}


def get(cfg: MegaliteConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


# ---- YAML groups ------------------------------------------------------------------------------------------------

def config_dir() -> Path:
    """The Hydra config tree: $MEGALITE_CONFIG_DIR if set, else the repository's configs/."""
    env = os.environ.get(CONFIG_DIR_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "configs"
    return path.resolve()  # Hydra's initialize_config_dir requires an absolute path


def group_options(group: str) -> list[str]:
    """The choices of a config group (``model`` -> gpt_tiny, llama2_7b, ...)."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def compose(overrides: list[str]) -> MegaliteConfig:
    """configs/ composed with ``overrides`` (group choices such as ``model=gpt_tiny`` and ``section.field=value``
    settings, applied left to right), as a typed MegaliteConfig; any error is a one-line ConfigError."""
    import hydra   # noqa: PLC0415 - Hydra and OmegaConf only where YAML files are composed
    from hydra.core.config_store import ConfigStore   # noqa: PLC0415
    from hydra.errors import HydraException   # noqa: PLC0415
    from omegaconf import OmegaConf   # noqa: PLC0415
    from omegaconf.errors import OmegaConfBaseException   # noqa: PLC0415

    directory = config_dir()
    if not directory.is_dir():
        raise ConfigError(f"config directory {directory} does not exist (check ${CONFIG_DIR_ENV})")
    # The dataclasses are the schema configs/config.yaml puts first in its defaults list: every key and value from
    # YAML files or overrides is then type-checked against MegaliteConfig by OmegaConf.
    ConfigStore.instance().store(name=SCHEMA_NAME, node=MegaliteConfig)
    try:
        with hydra.initialize_config_dir(config_dir=str(directory), version_base=None):
            cfg = hydra.compose(config_name="config", overrides=overrides)
        _reject_unknown_keys(cfg)
        result = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(f"bad override: {_one_line(exc)}") from exc
    if not isinstance(result, MegaliteConfig):  # e.g. a config.yaml that lost the schema from its defaults list
        raise ConfigError(f"{directory / 'config.yaml'} must list {SCHEMA_NAME} first in its defaults")
    return result


def _reject_unknown_keys(cfg: Any) -> None:
    """Raise on keys the schema lacks: ``+model.foo=1`` bypasses Hydra's struct check, and OmegaConf.to_object
    would then silently set ``foo`` as a stray attribute instead of failing on the typo."""
    known = {section: {f.name for f in dataclasses.fields(cls)} for section, cls in sections()}
    for section in cfg:
        if section not in known:
            raise ConfigError(f"bad override: unknown key {section!r} (sections: {', '.join(known)})")
        for name in cfg[section]:
            if name not in known[section]:
                raise ConfigError(f"bad override: unknown key '{section}.{name}'")


def _one_line(exc: BaseException) -> str:
    """A one-line summary of a Hydra/OmegaConf error, whose useful part is often not on the first line."""
    def first(e: BaseException) -> str:
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        if not lines:
            return type(e).__name__
        # "In 'model/x': ConfigKeyError raised while composing config:" puts the reason on the next line.
        if lines[0].endswith(":") and len(lines) > 1:
            return f"{lines[0]} {lines[1]}"
        return lines[0]
    message = first(exc).rstrip(".")
    # An unknown group option ("Could not find 'model/x'") lists the available ones further down; keep them.
    options = re.search(r"Available options in '[^']*':\n((?:\t.*\n?)+)", str(exc))
    if options:
        message += f" (options: {', '.join(line.strip() for line in options.group(1).splitlines())})"
    cause = exc.__cause__  # Hydra wraps OmegaConf's reason ("Key 'foo' not in 'ModelConfig'") as the cause
    if cause is not None and first(cause) not in message:
        message = f"{message}: {first(cause)}"
    return message
