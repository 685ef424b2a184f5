"""Reading the JSON-lines files runs write (the metrics file, the step-times file): one object per line, blank lines
skipped, anything else a one-line ConfigError naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

from megalite.config import ConfigError


def read_records(path: str | Path, what: str = "record") -> list[dict]:
    """Every line's object; each must be a JSON object with an ``iteration`` (``what`` names it in errors)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read it ({error.strerror or error})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or "iteration" not in record:
            raise ConfigError(f"{path}:{number}: not a {what} (a JSON object with an iteration)")
        records.append(record)
    if not records:
        raise ConfigError(f"{path}: no {what}s")
    return records
