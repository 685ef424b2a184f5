"""CheckpointError: a checkpoint that is missing, incomplete, corrupt or does not fit the model.

It is a ConfigError, so ``pretrain_gpt.py`` reports it like a bad option: one line naming the file or tensor and what
is wrong, exit code 2, on every rank. SaveError: a save that could not be written (a full or read-only disk), on
every rank alike, which ``pretrain_gpt.py`` reports in one line too. NotFiniteError: a save refused because what
it would write holds a NaN or an infinity (the run's failure, not a checkpoint's: the trainer reports it as a
training error, exit code 1).
"""

from __future__ import annotations

from megalite.config import ConfigError


class CheckpointError(ConfigError):
    """A bad checkpoint; the message names the checkpoint path and the first thing missing or wrong."""


class SaveError(RuntimeError):
    """A checkpoint that could not be written; the message names the directory and the first reason (another rank's
    in words), and ``directory`` is where the save was writing."""

    def __init__(self, message: str, directory: str):
        super().__init__(message)
        self.directory = directory


class NotFiniteError(RuntimeError):
    """A save refused on every rank: the weights or optimizer states it would write are not finite; nothing of it was
    written, and the pointer still names the latest good checkpoint."""
