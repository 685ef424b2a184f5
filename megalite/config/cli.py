"""Command line: Megatron-style flags and Hydra overrides, both resolved into one typed ``MegaliteConfig``.

Two spellings reach the same option (spelled by :mod:`megalite.config.flags`): ``--tensor-model-parallel-size 2``
and ``parallel.tensor_model_parallel_size=2``; ``model=gpt_tiny`` chooses a YAML file under configs/model/.

Precedence, lowest to highest: dataclass defaults < the group YAML files chosen in ``configs/config.yaml``
(or on the command line, e.g. ``model=gpt_tiny``) < a DeepSpeed JSON config (``--deepspeed-config ds.json``, see
:mod:`megalite.config.deepspeed`) < Hydra overrides (``optimizer.lr=3e-4``) < Megatron flags (``--lr 1e-3``). Flags
win because they are turned into Hydra overrides appended after the user's own, and Hydra applies overrides left to
right; the DeepSpeed config's settings go before both.

Only Hydra's compose API is used (not ``@hydra.main``), so Hydra never changes the working directory, never creates
``outputs/`` and never configures logging. Every parse or composition error becomes a one-line
:class:`~megalite.config.ConfigError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shlex
import typing
from typing import Optional

from megalite.config import deepspeed, megatron
from megalite.config.flags import CONVERTERS, FLAGS, compose, override
from megalite.config.schema import ConfigError, MegaliteConfig, sections


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
            convert = CONVERTERS[f.type]
            metavar = f.metavar or convert.__name__.upper()
            group.add_argument(f.flag, dest=f.key, type=convert, default=argparse.SUPPRESS,
                               metavar=f"{metavar} ..." if f.multi_word else metavar, help=help_text)
    megatron.add_accepted(groups)   # Megatron's flags that change nothing here: parsed, stored nowhere
    return parser


def _number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _weighted_blend(word: str) -> bool:
    """Whether one word is a whole blend, ``"0.3 A 0.7 B"`` (from ``--data-path "$BLEND"``), kept as words; any other
    word with a space is one value (a path)."""
    words = word.split()
    return len(words) <= 1 or (len(words) % 2 == 0 and all(_number(w) for w in words[0::2]))


def _join_flag_values(argv: list[str]) -> list[str]:
    """Each flag's value attached to it where argparse would misread it.

    ``--lr -1e-3`` -> ``--lr=-1e-3``: argparse takes a word starting with '-' for a flag (it knows "-1" but not
    "-1e-3" as a number), and would say "expected one argument"; joined, the number parses and validation says what
    is wrong with it. ``--data-path 0.3 A 0.7 B`` -> ``--data-path=0.3 A 0.7 B``: the words after a multi-word flag,
    up to the next flag or Hydra override (a word with '='), become its one string value, each word that holds a
    space shell-quoted so that it stays one word (a prefix ``"my corpus/text"`` given in quotes is one path, as in
    Megatron's nargs="+"), unless the word is a whole weighted blend: --data-path's words only (the one multi-word
    value read back shell-style; the others, such as a schedule given in one quoted word, split at whitespace). argparse's own nargs="+" would also swallow a following ``model=gpt_tiny``; a word that
    contains '=' can still be part of the value when given in one piece: ``--data-path='0.5 a=b 0.5 c'``."""
    multi_word = {f.flag for f in FLAGS if f.multi_word}
    takes_value = {f.flag for f in FLAGS if not f.is_switch and not f.multi_word}
    result, i = [], 0
    while i < len(argv):
        name, has_value, value = argv[i].partition("=")
        i += 1
        if name in takes_value and not has_value and i < len(argv) and argv[i].startswith("-") and _number(argv[i]):
            result.append(f"{name}={argv[i]}")
            i += 1
            continue
        if name not in multi_word:
            result.append(argv[i - 1])
            continue
        words = [value] if has_value else []
        while i < len(argv) and not argv[i].startswith("-") and "=" not in argv[i]:
            quoted = name == "--data-path" and not _weighted_blend(argv[i])   # the one value read shell-style
            words.append(shlex.quote(argv[i]) if quoted else argv[i])
            i += 1
        result.append(f"{name}={' '.join(words)}" if words else name)  # no words: argparse reports the flag
    return result


def split_argv(argv: list[str]) -> tuple[list[str], list[str], tuple[str, ...]]:
    """(Hydra overrides, flag overrides, Megatron flags accepted without effect) for argv; the flag overrides
    already formatted as ``section.field=value``."""
    namespace, rest = build_parser().parse_known_args(_join_flag_values(list(argv)))
    unknown = list(dict.fromkeys(arg.split("=")[0] for arg in rest if arg.startswith("-")))
    if unknown:
        raise ConfigError(_unknown_flags_message(unknown))
    values = vars(namespace)
    accepted = megatron.given(values)
    return rest, [override(key, value) for key, value in values.items()], accepted


def _unknown_flags_message(unknown: list[str]) -> str:
    """Every unknown flag of the command line at once, each with the nearest known spelling (if one is near)."""
    known = [f.flag for f in FLAGS] + [a.flag for a in megatron.ACCEPTED]

    def described(flag: str) -> str:
        nearest = difflib.get_close_matches(flag, known, n=1, cutoff=0.85)
        return f"{flag} (did you mean {nearest[0]}?)" if nearest else flag

    noun = "flag" if len(unknown) == 1 else "flags"
    return f"unknown {noun} {', '.join(described(f) for f in unknown)} (see --help)"


@dataclasses.dataclass(frozen=True)
class CommandLine:
    """A parsed command line: the config, and what a --deepspeed-config file contributed to it."""
    config: MegaliteConfig
    deepspeed: Optional[deepspeed.Translation] = None
    user_keys: frozenset = frozenset()   # keys the command line itself sets (they win over the DeepSpeed file)
    accepted: tuple[str, ...] = ()       # Megatron's flags it gave that change nothing here, as typed

    def deepspeed_settings(self) -> list[str]:
        """The DeepSpeed file's effective-settings table, for the start of a run (empty without a file)."""
        return self.deepspeed.settings_lines(self.config) if self.deepspeed else []


def parse_command_line(argv: list[str], world_size: Optional[int] = None) -> CommandLine:
    """Resolve Megatron flags, Hydra overrides and a --deepspeed-config file; any error is a one-line ConfigError.

    ``world_size`` (default: $WORLD_SIZE, else 1) is needed only by a DeepSpeed file's batch arithmetic, whose
    data-parallel size is world size / (TP x CP x PP). Does not run :func:`megalite.config.validate`.
    """
    hydra_overrides, flag_overrides, accepted = split_argv(argv)
    user_overrides = hydra_overrides + flag_overrides   # flags last, so they win over a Hydra override of the same key
    cfg = compose(user_overrides)
    megatron.check(cfg, accepted)
    path = cfg.training.deepspeed_config
    if path is None:
        return CommandLine(cfg, accepted=accepted)
    # Composed once without the file to learn its path, TP/PP and the command line's own values; then again with the
    # file's settings placed before the user's overrides, so those (and the flags) win over the file, and the file
    # wins over the YAML groups.
    user_keys = _keys_set_by(user_overrides)
    translation = deepspeed.translate(path, _world_size(world_size), cfg, user_keys)
    return CommandLine(compose(translation.overrides() + user_overrides), translation, user_keys, accepted)


def parse_args(argv: list[str], world_size: Optional[int] = None) -> MegaliteConfig:
    """The MegaliteConfig of a command line (see :func:`parse_command_line`); any error is a one-line ConfigError.

    Does not run :func:`megalite.config.validate` (cross-field rules need the world size).
    """
    return parse_command_line(argv, world_size).config


def _keys_set_by(overrides: list[str]) -> frozenset:
    """The ``section.field`` keys that overrides set (group choices such as ``model=gpt_tiny`` are not keys)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser   # noqa: PLC0415

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


