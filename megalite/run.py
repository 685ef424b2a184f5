"""One resolved run: every rule about a run worked out once, from the options and the world size, then read.

:meth:`Run.resolve` takes a parsed config through, in order: the ``--load`` checkpoint's tokenizer when the data
names none, ``--use-checkpoint-args`` (the saved model options), Megatron's silent corrections, every cross-field
rule at this world size, the data files, the tokenizer (built once: it decides the vocabulary, as in Megatron;
``--vocab-size`` only sizes mock data), and the ``--load`` checkpoint (same model, nothing missing). Each step can
refuse with one ConfigError line before any process group exists. What it returns holds the config with the
vocabulary filled in, the layout's sizes (:class:`megalite.config.dims.ParallelDims`), the tokenizer, and the
lines a run prints about what was adjusted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megalite.checkpoint import check_checkpoint, use_checkpoint_args, with_checkpoint_tokenizer
from megalite.config import MegaliteConfig, megatron, validate
from megalite.config.dims import ParallelDims
from megalite.data import check_data_files, run_tokenizer
from megalite.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class Run:
    cfg: MegaliteConfig              # every option; model.vocab_size is the tokenizer's
    dims: ParallelDims               # TP, CP, PP, EP and every size derived from them at this world size
    tokenizer: Optional[Tokenizer]   # None with mock data
    notes: tuple[str, ...] = ()      # what the checkpoint's options changed, Megatron's adjustments and no-op flags

    @classmethod
    def resolve(cls, cfg: MegaliteConfig, world_size: int, accepted: tuple[str, ...] = ()) -> "Run":
        """The run a command line's ``cfg`` describes at ``world_size`` ranks, checked (ConfigError, DataError or
        CheckpointError: one line, the same on every rank); ``accepted``: the command line's Megatron flags that
        change nothing here."""
        cfg = with_checkpoint_tokenizer(cfg)   # --data-path alone: the --load checkpoint's tokenizer
        cfg, notes = use_checkpoint_args(cfg)
        cfg, warnings = megatron.adjust(cfg)   # --sequence-parallel at TP=1 off, as Megatron does
        validate(cfg, world_size)
        run = cls.of(cfg, world_size, notes + warnings + megatron.start_lines(cfg, accepted))
        check_data_files(run.cfg, run.tokenizer)   # a corrupt file stops every rank here, not in a collective
        check_checkpoint(run.cfg, world_size, run.tokenizer)   # a missing, partial, corrupt or other model's one
        return run

    @classmethod
    def of(cls, cfg: MegaliteConfig, world_size: int, notes: list[str] = ()) -> "Run":
        """The run of options taken as they are (checked by :meth:`resolve`, or built by a test or a tool): the
        tokenizer built, its vocabulary filled in, the layout's sizes."""
        tokenizer = run_tokenizer(cfg)
        if tokenizer is not None:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
        return cls(cfg, ParallelDims.of(cfg.parallel, world_size), tokenizer, tuple(notes))
