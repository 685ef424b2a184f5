"""Digests of what a checkpoint stores, so that a load refuses bytes that changed since they were saved.

Recorded at save, in the manifest: one digest per tensor item (the bytes DCP wrote for it, located by DCP's index),
one of DCP's index (``.metadata``), one per tokenizer file, and one of the manifest itself. A load checks the
manifest, then the index before unpickling it, then every item it will read before any weight is used, and names
the first file and item whose bytes differ. Nothing is deserialized to check it (the ranges are hashed as stored,
through ``mmap``), so ``tools/convert_checkpoint.py verify`` checks a whole checkpoint without building a model.

The hash is XXH3-128 (the ``xxhash`` package: about 28 GB/s on one core, a few per cent of a save; see
``bench/checkpoint_bench.py``) where it is installed, else SHA-256 from the standard library (about 1.8 GB/s). The
manifest records which, so a checkpoint is checked with the algorithm it was saved with. They guard against
accidents (bit rot, a half-copied or overwritten file), not against someone forging a checkpoint.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Callable, Iterable
from pathlib import Path

from megalite.checkpoint.errors import CheckpointError

try:
    import xxhash
except ImportError:   # the standard library's SHA-256 does the same job, slower
    xxhash = None

XXH3 = "xxh3_128"
SHA256 = "sha256"


def default_algorithm() -> str:
    return XXH3 if xxhash is not None else SHA256


def _hasher(algorithm: str) -> Callable[[object], str]:
    if algorithm == XXH3:
        if xxhash is None:
            raise CheckpointError(f"this checkpoint's digests are {XXH3}, which needs the xxhash package: "
                                  f"pip install xxhash")
        return xxhash.xxh3_128_hexdigest
    if algorithm == SHA256:
        return lambda data: hashlib.sha256(data).hexdigest()
    raise CheckpointError(f"unknown digest algorithm {algorithm!r}")


def digest_bytes(data: bytes | memoryview, algorithm: str) -> str:
    return _hasher(algorithm)(data)


def digest_file(path: Path, algorithm: str) -> str:
    return digest_ranges(path, [(path.name, 0, path.stat().st_size)], algorithm)[path.name]


def digest_ranges(path: Path, ranges: Iterable[tuple[str, int, int]], algorithm: str) -> dict[str, str]:
    """name -> digest of bytes [offset, offset + length) of ``path``, for each (name, offset, length), read through
    one ``mmap`` of the file (pages already in the page cache, as right after a write, are not copied)."""
    hasher, ranges = _hasher(algorithm), list(ranges)
    size = path.stat().st_size
    for name, offset, length in ranges:
        if offset + length > size:
            raise CheckpointError(f"{path}: truncated ({size} of at least {offset + length} bytes, for {name})")
    if size == 0:
        return {name: hasher(b"") for name, _, _ in ranges}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return {name: hasher(view[offset:offset + length]) for name, offset, length in ranges}
        finally:
            view.release()   # before the map closes


def even_shares(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """[start, end) index ranges cutting ``sizes`` (in order) into ``parts`` contiguous runs of about equal total, so
    that ranks verifying a checkpoint together each read about the same number of bytes, sequentially."""
    total, bounds, running, start = sum(sizes), [], 0, 0
    for part in range(parts):
        end = start
        while end < len(sizes) and (part == parts - 1 or running + sizes[end] / 2 <= total * (part + 1) / parts):
            running += sizes[end]
            end += 1
        bounds.append((start, end))
        start = end
    return bounds
