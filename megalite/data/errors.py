"""DataError: a bad data or tokenizer file, reported like a bad option (one line naming the file, exit code 2)."""

from __future__ import annotations

from megalite.config import ConfigError


class DataError(ConfigError):
    """A missing, truncated or corrupt data/tokenizer file or input; the message names the file and what is wrong."""
