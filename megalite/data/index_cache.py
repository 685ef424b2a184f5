"""Index arrays built once per key and reused: ``<dir>/<name>-<hash>-<array>.npy``, memory-mapped on reuse.

The key is everything the arrays depend on (a JSON-able description, stored beside them for people to read), so a
changed input gives a new file name instead of a stale hit. Any process may build: builders are deterministic, so
racing processes write identical files, one builds under a lock while the others on the machine wait for it, and
every file appears whole through ``os.replace``. A directory that cannot be written is not fatal: the arrays are
then built in memory (with one warning) every time.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megalite.data.atomic import atomic_path, exclusive_lock

_warned: set[str] = set()


def cache_key(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def load_or_build(cache_dir: Path | None, name: str, description: dict, array_names: list[str],
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays of ``description``: from ``cache_dir`` if there, else ``build()`` them and save them there."""
    if cache_dir is None:
        return build()
    stem = Path(cache_dir) / f"{name}-{cache_key(description)}"
    paths = {array: stem.with_name(f"{stem.name}-{array}.npy") for array in array_names}
    arrays = _load(paths)
    if arrays is not None:
        return arrays
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        with exclusive_lock(stem.with_name(f".{stem.name}.lock")):
            arrays = _load(paths)  # built by another process while this one waited
            if arrays is not None:
                return arrays
            arrays = build()
            for array, path in paths.items():
                with atomic_path(path) as temporary:
                    with open(temporary, "wb") as handle:
                        np.save(handle, arrays[array])
            with atomic_path(stem.with_name(f"{stem.name}-description.json")) as temporary:
                temporary.write_text(json.dumps(description, indent=1, sort_keys=True) + "\n")
            return arrays
    except OSError as error:
        if str(cache_dir) not in _warned:
            _warned.add(str(cache_dir))
            warnings.warn(f"megalite: cannot cache data indices in {cache_dir} ({error.strerror or error}); building "
                          f"them in memory on every start (set --data-cache-path to a writable directory)",
                          RuntimeWarning, stacklevel=2)
        return arrays if arrays is not None else build()


def _load(paths: dict[str, Path]) -> dict[str, np.ndarray] | None:
    try:
        return {array: np.load(path, mmap_mode="r", allow_pickle=False) for array, path in paths.items()}
    except (OSError, ValueError):  # missing, or unreadable (a disk that filled up): rebuild
        return None

