"""Files that several processes build without talking to each other: atomic writes and an exclusive build lock.

Data files, cached indices and the built-in corpus are made before any process group exists (so a bad file fails
alone instead of hanging a collective). Every builder is deterministic and writes to a private temporary name, then
``os.replace``s it into place: a reader sees the old file or the whole new one, never a torn one, and two processes
racing write identical bytes. For expensive one-time builds, :func:`exclusive_lock` lets one process build while the
others wait, then they all reuse the result (flock is released by the kernel if its holder dies).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


def temporary_path(path: str | os.PathLike) -> Path:
    """A name beside ``path`` that no other process (or call) uses, for writing before ``os.replace``."""
    target = Path(path)
    return target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` on success, removed on failure."""
    target = Path(path)
    temporary = temporary_path(target)
    try:
        yield temporary
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as temporary:
        temporary.write_bytes(data)


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing), blocking until the current holder lets go."""
    lock_path = Path(path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
