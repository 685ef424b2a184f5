"""Command line: Megatron-style flags and Hydra overrides, both resolved into one typed ``MegaliteConfig``.

Two spellings reach the same option::

    --tensor-model-parallel-size 2      # Megatron flag (also --tensor-model-parallel-size=2)
    parallel.tensor_model_parallel_size=2   # Hydra override
    model=gpt_tiny                      # Hydra config-group choice (a YAML file under configs/model/)

The flag table is derived from the dataclass fields in :mod:`megalite.config` (``section.field_name`` ->
``--field-name``), so an option is declared exactly once, with its type, default and help. A string field marked
``nargs="+"`` takes several words as in Megatron (``--data-path 0.3 A 0.7 B``), joined by spaces into its one value.

Precedence, lowest to highest: dataclass defaults < the group YAML files chosen in ``configs/config.yaml``
(or on the command line, e.g. ``model=gpt_tiny``) < a DeepSpeed JSON config (``--deepspeed-config ds.json``, see
:mod:`megalite.deepspeed_config`) < Hydra overrides (``optimizer.lr=3e-4``) < Megatron flags (``--lr 1e-3``). Flags
win because they are turned into Hydra overrides appended after the user's own, and Hydra applies overrides left to
right; the DeepSpeed config's settings go before both.

Only Hydra's compose API is used (not ``@hydra.main``), so Hydra never changes the working directory, never creates
``outputs/`` and never configures logging. Every parse or composition error becomes a one-line
:class:`~megalite.config.ConfigError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Quote, QuotedString
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megalite import deepspeed_config
from megalite.config import ConfigError, MegaliteConfig, sections

SCHEMA_NAME = "megalite_schema"  # referenced by the defaults list of configs/config.yaml
CONFIG_DIR_ENV = "MEGALITE_CONFIG_DIR"

# Types a field may have, mapped to the argparse converter of its flag (None: a bool switch, no value).
_SUPPORTED_TYPES = {int: int, float: float, str: str, bool: None,
                    Optional[int]: int, Optional[float]: float, Optional[str]: str}


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


def build_flag_table() -> list[Flag]:
    """One Flag per dataclass field, in declaration order; raises if two fields would share a flag."""
    table: list[Flag] = []
    seen = {"--help": "argparse"}  # -h/--help is argparse's own
    for section, cls in sections():
        hints = typing.get_type_hints(cls)  # resolves the string annotations of `from __future__ import annotations`
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            key = f"{section}.{field.name}"
            if flag in seen:
                raise RuntimeError(f"{key} and {seen[flag]} would both be the flag {flag}; rename one field")
            seen[flag] = key
            ftype = hints[field.name]
            if ftype not in _SUPPORTED_TYPES:
                raise RuntimeError(f"{key}: type {ftype} has no flag support")
            if ftype is bool and field.default is not False:
                # A switch can only turn an option on; a True default would need a --no-x pair, which we avoid.
                raise RuntimeError(f"{key}: bool options must default to False")
            help_text = field.metadata.get("help", "")
            if not help_text:
                raise RuntimeError(f"{key} has no help text")
            multi_word = field.metadata.get("nargs") == "+"
            if multi_word and ftype not in (str, Optional[str]):
                raise RuntimeError(f"{key}: only string options may take several words")
            table.append(Flag(flag, section, field.name, ftype, field.default, help_text, multi_word,
                              field.metadata.get("metavar")))
    return table


FLAGS = build_flag_table()  # checked at import, so a clash fails loudly before any run

# Register the dataclasses as the schema that configs/config.yaml puts first in its defaults list: every key and
# value from YAML files or overrides is then type-checked against MegaliteConfig by OmegaConf.
ConfigStore.instance().store(name=SCHEMA_NAME, node=MegaliteConfig)


def config_dir() -> Path:
    """The Hydra config tree: $MEGALITE_CONFIG_DIR if set, else the repository's configs/."""
    env = os.environ.get(CONFIG_DIR_ENV)
    path = Path(env) if env else Path(__file__).resolve().parent.parent / "configs"
    return path.resolve()  # Hydra's initialize_config_dir requires an absolute path


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting with status 2."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message.splitlines()[0] if message else "bad command line")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the Megatron flags (Hydra overrides are passed through untouched)."""
    parser = _Parser(
        prog="megalite",
        description="Train a GPT. Options are Megatron-style --flags or Hydra overrides, in any order:\n"
        "  positional arguments are Hydra overrides (optimizer.lr=3e-4) or config-group choices (model=gpt_tiny,\n"
        "  see configs/).\n"
        "Precedence, lowest first: dataclass defaults < group YAML files < --deepspeed-config JSON < Hydra\n"
        "overrides < --flags, so a flag wins over a Hydra override of the same key. Defaults below are the\n"
        "dataclass defaults; the default groups of configs/config.yaml may change them (data=mock turns\n"
        "--mock-data on).\n"
        "Without --data-path or --mock-data the built-in corpus is used (built once, then cached).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # "--tensor" must not silently mean --tensor-model-parallel-size
        usage="%(prog)s [--flag VALUE ...] [section.key=value ...] [group=option ...]",
    )
    groups = {section: parser.add_argument_group(f"{section} options") for section, _ in sections()}
    for f in FLAGS:
        # '%' would be read as an argparse format directive; SUPPRESS keeps unset flags out of the namespace so
        # they never override the YAML files or Hydra overrides.
        help_text = f"{f.help} (hydra: {f.key}; default: {f.default})".replace("%", "%%")
        group = groups[f.section]
        if f.is_switch:
            group.add_argument(f.flag, dest=f.key, action="store_true", default=argparse.SUPPRESS, help=help_text)
        else:
            convert = _SUPPORTED_TYPES[f.type]
            metavar = f.metavar or convert.__name__.upper()
            group.add_argument(f.flag, dest=f.key, type=convert, default=argparse.SUPPRESS,
                               metavar=f"{metavar} ..." if f.multi_word else metavar, help=help_text)
    return parser


def _quote(value: Any) -> str:
    """A Python value as the right-hand side of a Hydra override, read back as exactly that value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr round-trips floats; inf and nan are valid Hydra literals too
    # Strings are always quoted (so "1", "true", "a,b" or "x=y" stay strings), and "${" is escaped so OmegaConf does
    # not resolve it as an interpolation; backslashes just before it are doubled, as OmegaConf unescapes them.
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", str(value))
    return QuotedString(text=text, quote=Quote.single).with_quotes()


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


def _join_multi_word_values(argv: list[str]) -> list[str]:
    """``--data-path 0.3 A 0.7 B`` -> ``--data-path=0.3 A 0.7 B``: the words after a multi-word flag, up to the next
    flag or Hydra override (a word with '='), become its one string value. argparse's own nargs="+" would also
    swallow a following ``model=gpt_tiny``; a word that contains '=' can still be part of the value when given in
    one piece: ``--data-path='0.5 a=b 0.5 c'``."""
    multi_word = {f.flag for f in FLAGS if f.multi_word}
    result, i = [], 0
    while i < len(argv):
        name, has_value, value = argv[i].partition("=")
        i += 1
        if name not in multi_word:
            result.append(argv[i - 1])
            continue
        words = [value] if has_value else []
        while i < len(argv) and not argv[i].startswith("-") and "=" not in argv[i]:
            words.append(argv[i])
            i += 1
        result.append(f"{name}={' '.join(words)}" if words else name)  # no words: argparse reports the flag
    return result


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra overrides, flag overrides) for argv; the latter already formatted as ``section.field=value``."""
    namespace, rest = build_parser().parse_known_args(_join_multi_word_values(list(argv)))
    unknown = [arg for arg in rest if arg.startswith("-")]
    if unknown:
        raise ConfigError(f"unknown flag {unknown[0].split('=')[0]} (see --help)")
    flag_overrides = [f"{key}={_quote(value)}" for key, value in vars(namespace).items()]
    return rest, flag_overrides


@dataclasses.dataclass(frozen=True)
class CommandLine:
    """A parsed command line: the config, and what a --deepspeed-config file contributed to it."""
    config: MegaliteConfig
    deepspeed: Optional[deepspeed_config.Translation] = None
    user_keys: frozenset = frozenset()   # keys the command line itself sets (they win over the DeepSpeed file)

    def describe(self) -> list[str]:
        """The DeepSpeed file's mappings, one line each, for the start of a run (empty without a file)."""
        return self.deepspeed.describe(self.config, self.user_keys) if self.deepspeed else []


def parse_command_line(argv: list[str], world_size: Optional[int] = None) -> CommandLine:
    """Resolve Megatron flags, Hydra overrides and a --deepspeed-config file; any error is a one-line ConfigError.

    ``world_size`` (default: $WORLD_SIZE, else 1) is needed only by a DeepSpeed file's batch arithmetic, whose
    data-parallel size is world size / (TP x PP). Does not run :func:`megalite.config.validate`.
    """
    hydra_overrides, flag_overrides = split_argv(argv)
    user_overrides = hydra_overrides + flag_overrides   # flags last, so they win over a Hydra override of the same key
    cfg = _compose(user_overrides)
    path = cfg.training.deepspeed_config
    if path is None:
        return CommandLine(cfg)
    # Composed once without the file to learn its path, TP/PP and the command line's own values; then again with the
    # file's settings placed before the user's overrides, so those (and the flags) win over the file, and the file
    # wins over the YAML groups.
    user_keys = _keys_set_by(user_overrides)
    translation = deepspeed_config.translate(path, _world_size(world_size), cfg, user_keys)
    return CommandLine(_compose(translation.overrides() + user_overrides), translation, user_keys)


def parse_args(argv: list[str], world_size: Optional[int] = None) -> MegaliteConfig:
    """The MegaliteConfig of a command line (see :func:`parse_command_line`); any error is a one-line ConfigError.

    Does not run :func:`megalite.config.validate` (cross-field rules need the world size).
    """
    return parse_command_line(argv, world_size).config


def _compose(overrides: list[str]) -> MegaliteConfig:
    """Hydra's composition of configs/ with ``overrides`` (applied left to right), as a typed MegaliteConfig."""
    directory = config_dir()
    if not directory.is_dir():
        raise ConfigError(f"config directory {directory} does not exist (check ${CONFIG_DIR_ENV})")
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


def _keys_set_by(overrides: list[str]) -> frozenset:
    """The ``section.field`` keys that overrides set (group choices such as ``model=gpt_tiny`` are not keys)."""
    parsed = OverridesParser.create().parse_overrides(overrides)   # already composed once: they parse
    return frozenset(o.key_or_group for o in parsed if "." in o.key_or_group)


def _world_size(world_size: Optional[int]) -> int:
    if world_size is not None:
        return world_size
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"$WORLD_SIZE must be an integer, got {text!r}") from None


def config_to_dict(cfg: MegaliteConfig) -> dict:
    """The config as a plain nested dict (section -> field -> value), for logging and metrics files."""
    return dataclasses.asdict(cfg)
