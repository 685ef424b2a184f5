"""Coming from Megatron-LM: what its command lines need beyond the options themselves.

Megatron's scripts pass flags that only choose between Megatron's own implementations (``--use-mcore-models``,
``--attention-backend``, ``--ckpt-format torch_dist``, ...). Each is an option of the schema marked
``accepted_only``, whose help says what it means here; :func:`without_effect` names the ones a command line gave,
with the flags that change nothing in context (``--tiktoken-pattern`` beside another tokenizer, ``--no-position-
embedding`` with rotary positions), for the one line a run starts with. Values megalite cannot honour are refused
by :mod:`megalite.config.validate`, like any other bad value.

:func:`adjust` makes the one change Megatron makes with a warning instead of an error: ``--sequence-parallel`` at
``--tensor-model-parallel-size 1`` is turned off.
"""

from __future__ import annotations

import dataclasses

from megalite.config.flags import FLAG, FLAGS, get
from megalite.config.schema import MegaliteConfig

TIKTOKENIZER = "TikTokenizer"


def adjust(cfg: MegaliteConfig) -> tuple[MegaliteConfig, list[str]]:
    """``cfg`` with Megatron's silent corrections applied, and a warning line for each."""
    warnings = []
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=False))
        warnings.append(f"megalite: warning: {FLAG.sequence_parallel} turned off: it needs "
                        f"{FLAG.tensor_model_parallel_size} > 1 (Megatron turns it off too)")
    return cfg, warnings


def without_effect(cfg: MegaliteConfig) -> list[str]:
    """The Megatron flags ``cfg`` sets that change nothing here, as a user would type them."""
    given = [f for f in FLAGS if f.accepted_only and get(cfg, f.key) != f.default]
    words = [f.flag if f.is_switch else f"{f.flag} {get(cfg, f.key)}" for f in given]
    d, m = cfg.data, cfg.model
    if d.tiktoken_pattern is not None and d.tokenizer_type != TIKTOKENIZER:
        words.append(f"{FLAG.tiktoken_pattern} {d.tiktoken_pattern} (the tokenizer is {d.tokenizer_type})")
    if m.no_position_embedding and m.position_embedding_type != "learned_absolute":
        words.append(f"{FLAG.no_position_embedding} (positions are {m.position_embedding_type})")
    return words


def start_lines(cfg: MegaliteConfig) -> list[str]:
    """What a run prints about its Megatron flags before it starts (nothing when there is nothing to say)."""
    words = without_effect(cfg)
    if not words:
        return []
    return [f"megalite: accepted without effect here (README: Coming from Megatron-LM): {', '.join(words)}"]
