"""CheckpointError: a checkpoint that is missing, incomplete, corrupt or does not fit the model.

It is a ConfigError, so ``pretrain_gpt.py`` reports it like a bad option: one line naming the file or tensor and what
is wrong, exit code 2, on every rank.
"""

from __future__ import annotations

from megalite.config import ConfigError


class CheckpointError(ConfigError):
    """A bad checkpoint; the message names the checkpoint path and the first thing missing or wrong."""
