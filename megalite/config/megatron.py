"""Coming from Megatron-LM: what its command lines need beyond the options themselves.

Megatron's scripts pass flags that only choose between Megatron's own implementations (``--use-mcore-models``,
``--attention-backend``, ``--ckpt-format torch_dist``, ...). They are no options here: :data:`ACCEPTED` lists them
for the parser (which takes each with its value, refuses a value megalite cannot honour, and lists them in
``--help``), nothing stores them, and :func:`start_lines` names the ones a command line gave, with the flags that
change nothing in context (``--tiktoken-pattern`` beside another tokenizer, ``--no-position-embedding`` with rotary
positions), in the one line a run starts with.

:func:`adjust` makes the one change Megatron makes with a warning instead of an error: ``--sequence-parallel`` at
``--tensor-model-parallel-size 1`` is turned off.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable, Optional

from megalite.config.flags import FLAG
from megalite.config.schema import ConfigError, MegaliteConfig

TIKTOKENIZER = "TikTokenizer"


@dataclasses.dataclass(frozen=True)
class Accepted:
    """A Megatron flag accepted without effect."""
    flag: str
    section: str                   # the --help group it is listed in (and where older manifests stored it)
    help: str
    type: Optional[type] = None    # of its one value; None: a switch
    choices: Optional[tuple[str, ...]] = None   # the values that are no-ops here (others are refused)


ACCEPTED = (
    Accepted("--attention-backend", "model", "Megatron's choice of attention implementation: megalite picks its "
             "attention core itself (scaled_dot_product_attention, flash or memory-efficient kernels on GPUs; "
             "--use-fused-kernels on for the fused masked softmax).", str,
             ("auto", "flash", "fused", "unfused", "local")),
    Accepted("--num-workers", "data", "Megatron's data-loader worker processes: megalite reads samples in the "
             "training process (the memory-mapped files need no workers).", int),
    Accepted("--no-mmap-bin-files", "data", "Megatron's switch from memory-mapped to read() access of the .bin files: "
             "megalite always maps them."),
    Accepted("--no-create-attention-mask-in-dataloader", "data", "Megatron's switch off of the data loader's "
             "attention masks: megalite never builds one (causal attention needs none)."),
    Accepted("--calculate-per-token-loss", "training", "Megatron's loss normalized by the token count of the whole "
             "global batch instead of per micro-batch: megalite always normalizes so (and its samples have no masked "
             "tokens, so Megatron's default gives the same loss)."),
    Accepted("--use-mcore-models", "training", "Megatron's switch from its legacy models to Megatron Core's: "
             "megalite has one model."),
    Accepted("--log-throughput", "logging", "Megatron's switch for throughput in the log: megalite always logs "
             "tokens/s, TFLOP/s per device and MFU."),
    Accepted("--use-pytorch-profiler", "logging", "Megatron's choice of torch.profiler over nsys for --profile: "
             "megalite always records with torch.profiler (and marks the range for nsys on GPUs)."),
    Accepted("--ckpt-format", "checkpoint", "Megatron's checkpoint format: megalite writes torch.distributed."
             "checkpoint shards with a JSON manifest, which is torch_dist's kind; other formats are refused.", str,
             ("torch_dist",)),
    Accepted("--cross-entropy-loss-fusion", "kernels", "Megatron's opt-in for the fused cross entropy: megalite "
             "fuses it by default (see --no-cross-entropy-loss-fusion)."),
)
# Their ``section.field`` keys in the configs of older manifests (they were options), read back without a word.
SAVED_BEFORE = frozenset(f"{a.section}.{a.flag[2:].replace('-', '_')}" for a in ACCEPTED)


def add_accepted(groups: dict[str, Any]) -> None:
    """Add the :data:`ACCEPTED` flags to a parser's groups (one per config section), each parsed into the namespace
    under its flag (``--ckpt-format``), where :func:`given` finds it."""
    for a in ACCEPTED:
        value = ({"action": "store_true"} if a.type is None else
                 {"type": a.type, "choices": a.choices, "metavar": "|".join(a.choices or [a.type.__name__.upper()])})
        groups[a.section].add_argument(a.flag, dest=a.flag, default=argparse.SUPPRESS,
                                       help=f"{a.help} Accepted without effect.", **value)


def given(values: dict[str, Any]) -> tuple[str, ...]:
    """The accepted flags among a parser's ``values`` (taken out of them), as a user would type them."""
    found = [(a, values.pop(a.flag)) for a in ACCEPTED if a.flag in values]
    return tuple(a.flag if a.type is None else f"{a.flag} {value}" for a, value in found)


def check(cfg: MegaliteConfig, accepted: Iterable[str]) -> None:
    """Raise ConfigError where an accepted flag contradicts an option."""
    if "--cross-entropy-loss-fusion" in accepted and cfg.kernels.no_cross_entropy_loss_fusion:
        raise ConfigError(f"--cross-entropy-loss-fusion and {FLAG.no_cross_entropy_loss_fusion} exclude each other")


def adjust(cfg: MegaliteConfig) -> tuple[MegaliteConfig, list[str]]:
    """``cfg`` with Megatron's silent corrections applied, and a warning line for each."""
    warnings = []
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=False))
        warnings.append(f"megalite: warning: {FLAG.sequence_parallel} turned off: it needs "
                        f"{FLAG.tensor_model_parallel_size} > 1 (Megatron turns it off too)")
    return cfg, warnings


def without_effect(cfg: MegaliteConfig, accepted: Iterable[str] = ()) -> list[str]:
    """The Megatron flags of a command line that change nothing here: the ``accepted`` ones it gave, and those
    ``cfg`` sets that change nothing in context."""
    words = list(accepted)
    d, m = cfg.data, cfg.model
    if d.tiktoken_pattern is not None and d.tokenizer_type != TIKTOKENIZER:
        words.append(f"{FLAG.tiktoken_pattern} {d.tiktoken_pattern} (the tokenizer is {d.tokenizer_type})")
    if m.no_position_embedding and m.position_embedding_type != "learned_absolute":
        words.append(f"{FLAG.no_position_embedding} (positions are {m.position_embedding_type})")
    return words


def start_lines(cfg: MegaliteConfig, accepted: Iterable[str] = ()) -> list[str]:
    """What a run prints about its Megatron flags before it starts (nothing when there is nothing to say)."""
    words = without_effect(cfg, accepted)
    if not words:
        return []
    return [f"megalite: accepted without effect here (README: Coming from Megatron-LM): {', '.join(words)}"]
