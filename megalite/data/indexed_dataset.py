"""Token files: ``PREFIX.bin`` (every document's tokens back to back) and ``PREFIX.idx`` (where each one is).

The layout is Megatron's ``MMIDIDX`` version 1, so files from either tool read in the other. ``.idx``, little-endian:

    magic    9 bytes   b"MMIDIDX\\x00\\x00"
    version  uint64    1
    dtype    uint8     code of the token type in .bin (8 = uint16, 4 = int32, ...)
    count    uint64    N sequences
    docs     uint64    D + 1 document boundaries
    sizes    int32[N]  tokens per sequence
    offsets  int64[N]  byte offset of each sequence in .bin
    bounds   int64[D+1] first sequence of each document, then N

The preprocessor writes one sequence per document (bounds = 0..N). Tokens are uint16 while the vocabulary fits,
else int32. Both files are memory-mapped, never read whole. Opening checks everything that can be checked from the
sizes alone (header, sizes against offsets, offsets against the .bin size); :func:`check_token_range` scans the
tokens themselves and caches its verdict, since that costs a pass over the whole .bin.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from megalite.data.atomic import temporary_path, write_atomically
from megalite.data.errors import DataError
from megalite.progress import Progress

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document boundary count
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_CODES = {np.dtype(t): code for code, t in DTYPES.items()}
_TOKEN_SCAN_CHUNK = 1 << 24  # tokens per step of the range scan (32-64 MiB of memory)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in it, else int32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def data_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def index_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


class IndexedDatasetWriter:
    """Appends documents to ``PREFIX.bin``; :meth:`finalize` writes ``PREFIX.idx``. Both appear only when finalized
    (written under temporary names, then renamed), so an interrupted run leaves no half dataset behind."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype):
        self.prefix, self.dtype = os.fspath(prefix), np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_path = temporary_path(data_file(self.prefix))
        self._bin: BinaryIO = open(self._bin_path, "wb")
        self._sizes: list[int] = []
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError("a document is a 1-D array of token ids")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(len(array))
        self.num_tokens += len(array)

    def finalize(self) -> None:
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        offsets = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        offsets *= self.dtype.itemsize
        bounds = np.arange(len(sizes) + 1, dtype=np.int64)
        header = _HEADER.pack(MAGIC, VERSION, _CODES[self.dtype], len(sizes), len(bounds))
        # .bin first: a reader that finds the new .idx also finds the .bin it describes.
        os.replace(self._bin_path, data_file(self.prefix))
        write_atomically(index_file(self.prefix), header + sizes.tobytes() + offsets.tobytes() + bounds.tobytes())

    def abort(self) -> None:
        """Forget what was written (the temporary .bin is removed)."""
        self._bin.close()
        self._bin_path.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _map(path: Path, dtype: np.dtype, offset: int = 0, count: int = -1) -> np.ndarray:
    """A read-only memory map of ``path`` (an empty array for an empty range: mmap refuses zero bytes)."""
    if count == 0 or path.stat().st_size == offset:
        return np.empty(0, dtype=dtype)
    shape = None if count < 0 else (count,)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


class IndexedDataset:
    """A validated, memory-mapped ``PREFIX.bin``/``PREFIX.idx`` pair; ``self[i]`` is sequence ``i``'s tokens."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self.index_path, self.data_path = index_file(self.prefix), data_file(self.prefix)
        self._open()

    def _open(self) -> None:
        idx, bin_ = self.index_path, self.data_path
        for path in (idx, bin_):
            if not path.is_file():
                hint = " (give the prefix, without .bin/.idx)" if self.prefix.endswith((".bin", ".idx")) else ""
                raise DataError(f"{path}: file not found{hint}")
        idx_size, bin_size = idx.stat().st_size, bin_.stat().st_size
        if idx_size < _HEADER.size:
            raise DataError(f"{idx}: truncated: {idx_size} bytes, shorter than the {_HEADER.size}-byte header")
        with open(idx, "rb") as handle:
            magic, version, code, count, num_bounds = _HEADER.unpack(handle.read(_HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{idx}: not an index file (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise DataError(f"{idx}: unsupported index version {version} (expected {VERSION})")
        if code not in DTYPES:
            raise DataError(f"{idx}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        if self.dtype.kind not in "iu":
            raise DataError(f"{idx}: token dtype {self.dtype} is not an integer type")
        expected = _HEADER.size + 12 * count + 8 * num_bounds
        if idx_size != expected:
            what = "truncated" if idx_size < expected else "too long"
            raise DataError(f"{idx}: {what}: {idx_size} bytes, but its header ({count} sequences, {num_bounds} "
                            f"document boundaries) needs {expected}")
        self.sizes = _map(idx, np.dtype(np.int32), _HEADER.size, count)
        self.offsets = _map(idx, np.dtype(np.int64), _HEADER.size + 4 * count, count)
        self.document_bounds = _map(idx, np.dtype(np.int64), _HEADER.size + 12 * count, num_bounds)
        self._check_layout(bin_size)
        self.tokens = _map(bin_, self.dtype)

    def _check_layout(self, bin_size: int) -> None:
        """Sizes, offsets and boundaries must describe the .bin exactly, so no read can go out of bounds."""
        idx, itemsize, sizes, offsets = self.index_path, self.dtype.itemsize, self.sizes, self.offsets
        if len(sizes) and int(sizes.min()) < 0:
            i = int(np.argmax(sizes < 0))
            raise DataError(f"{idx}: sequence {i} has a negative length {int(sizes[i])}")
        total = int(sizes.sum(dtype=np.int64)) * itemsize
        if total != bin_size:
            raise DataError(f"{self.data_path}: {bin_size} bytes, but the sizes in {idx.name} add up to {total} "
                            f"({'truncated' if bin_size < total else 'trailing bytes'})")
        ends = offsets + sizes.astype(np.int64) * itemsize
        if len(sizes) and (int(offsets.min()) < 0 or int(ends.max()) > bin_size):
            i = int(np.argmax((offsets < 0) | (ends > bin_size)))
            raise DataError(f"{idx}: sequence {i} spans bytes [{int(offsets[i])}, {int(ends[i])}), outside "
                            f"{self.data_path} ({bin_size} bytes)")
        expected = np.zeros_like(offsets)
        if len(sizes) > 1:
            np.cumsum(ends[:-1] - offsets[:-1], out=expected[1:])
        if not np.array_equal(offsets, expected):
            i = int(np.argmax(offsets != expected))
            raise DataError(f"{idx}: sequence {i} starts at byte {int(offsets[i])}, but the sizes before it add up "
                            f"to {int(expected[i])}")
        bounds = self.document_bounds
        if (len(bounds) == 0 or int(bounds[0]) != 0 or int(bounds[-1]) != len(sizes)
                or bool(np.any(np.diff(bounds) < 0))):
            raise DataError(f"{idx}: document boundaries do not rise from 0 to the sequence count {len(sizes)}")

    # Memory maps do not pickle cheaply (numpy would copy the data): a pickled dataset reopens its files.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def index_md5(self) -> str:
        """md5 of the .idx file: the sizes it holds are all that sample indices depend on (the cache key)."""
        return hashlib.md5(self.index_path.read_bytes()).hexdigest()

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (to its end when length is None); a view."""
        size = int(self.sizes[index])
        if length is None:
            length = size - offset
        if not (0 <= offset and 0 <= length and offset + length <= size):
            raise IndexError(f"tokens [{offset}, {offset + length}) of sequence {index} (length {size})")
        start = int(self.offsets[index]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)


def check_token_range(dataset: IndexedDataset, vocab_size: int, cache_dir: Path | None = None,
                      progress: bool = True) -> None:
    """Raise DataError if a token id is negative or >= ``vocab_size``.

    A pass over the whole .bin, so the largest id found is remembered in ``cache_dir`` (keyed by the file's path,
    size and modification time): later runs, and ranks that come after the first, only read that note. ``progress``:
    a bar on a terminal while the pass runs (megalite.progress).
    """
    path = dataset.data_path
    stat = path.stat()
    note = None
    if cache_dir is not None:
        key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
        note = Path(cache_dir) / f"{path.stem}-{hashlib.md5(key.encode()).hexdigest()[:16]}-max-token.json"
        try:
            if int(json.loads(note.read_text())["max_token"]) < vocab_size:
                return
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no note yet (or an unreadable one): scan
    high = -1
    tokens = dataset.tokens
    with Progress(len(tokens), f"checking the tokens of {path.name}", "tokens", enabled=progress) as bar:
        for start in range(0, len(tokens), _TOKEN_SCAN_CHUNK):
            chunk = tokens[start:start + _TOKEN_SCAN_CHUNK]
            chunk_low, chunk_high = int(chunk.min()), int(chunk.max())
            if chunk_high >= vocab_size or chunk_low < 0:
                at = start + int(np.argmax((chunk >= vocab_size) | (chunk < 0)))
                raise DataError(f"{path}: token {int(tokens[at])} at position {at} is outside the tokenizer's "
                                f"vocabulary [0, {vocab_size})")
            high = max(high, chunk_high)
            bar.update(len(chunk))
    if note is not None:
        try:
            note.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(note, json.dumps({"max_token": high}).encode())
        except OSError:
            pass  # a read-only cache only costs the scan next time
