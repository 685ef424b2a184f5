"""Text files as a token source beside ``PREFIX.bin``/``PREFIX.idx``: a ``--data-path`` word naming a Parquet, Arrow
or JSON-lines file, or a ``datasets.save_to_disk`` directory, whose ``--json-keys`` column holds the documents.

Documents are tokenized on the fly, when a sample that holds them is read (in the prefetch thread, while the step
before trains); the token stream is never stored. What is stored, once per (file, keys, tokenizer) in the index
cache (index_cache), is each document's token count and where its text is (a row, or a JSON line's byte offset): the
sample index (gpt_dataset) needs the counts to say which tokens sample ``j`` holds without reading the samples before
it, so a sample is the same tokens whatever the layout or the step a run resumed at, and ``--split``, the epochs'
shuffles and blending work as for .bin/.idx. That costs one pass that tokenizes the whole file on first use (the
preprocessor's work, without writing the tokens) and 13 bytes per document on disk.

The documents are those the preprocessor would write for the same text (``tools/preprocess_data.py --append-eod``):
in file order, one per key of each record, blank ones and those that encode to nothing skipped, each followed by the
end-of-document token, so both give the same samples. Reading a sample costs tokenizing each document it touches in
full (a document of L tokens is tokenized about L / seq_length times per epoch); a Parquet row is read by decoding
its row group (the last few are kept), so Parquet files written with small row groups read faster.

pyarrow (and ``datasets``, for a directory) is imported only when such a source is named.
"""

from __future__ import annotations

import array
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from megalite.data.documents import JSON_SUFFIXES
from megalite.data.errors import DataError
from megalite.data.index_cache import cache_key, load_or_build
from megalite.data.tokenizer import Tokenizer
from megalite.progress import Progress

TABLE_SUFFIXES = (".parquet", ".arrow")
_INDEX_VERSION = 1
_BATCH_ROWS = 1024          # rows per batch of the counting pass
_ROW_GROUPS_KEPT = 4        # decoded Parquet row groups kept for the next reads


def is_text_source(word: str) -> bool:
    """Whether a --data-path word names a text source rather than a .bin/.idx prefix (a prefix wins when both
    exist)."""
    if os.path.exists(f"{word}.idx"):
        return False
    return word.endswith(TABLE_SUFFIXES + JSON_SUFFIXES) or os.path.isdir(word)


class _JsonLines:
    """A JSON-lines file: a record's place is its line's byte offset (records are read with one seek)."""

    def __init__(self, path: Path, keys: Sequence[str]):
        self.path, self.keys = path, keys
        self.extent, self.unit = path.stat().st_size, "bytes"   # what places run through, for progress bars

    def records(self) -> Iterator[tuple[int, int, Optional[str]]]:
        """(place, key index, text or None for a value that is no text) of every record, as documents.py reads
        them (a bad record after good ones is skipped, a missing key or a first record that is not JSON is an
        error)."""
        offset, records = 0, 0
        with open(self.path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                place, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                records += 1
                record = self._decode(raw, number, first=records == 1)
                if record is None:
                    continue
                for k, key in enumerate(self.keys):
                    if key not in record:
                        raise DataError(f"{self.path}:{number}: no key {key!r} (see --json-keys)")
                    yield place, k, _text(record[key])

    def _decode(self, raw: bytes, number: int, first: bool) -> Optional[dict]:
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise DataError(f"{self.path}:{number}: not UTF-8 text") from None
        except (ValueError, RecursionError):
            record = None
        if isinstance(record, dict):
            return record
        if first:
            raise DataError(f"{self.path}:{number}: not a JSON object; a .jsonl/.json input holds one JSON object "
                            f"per line")
        return None

    def text(self, place: int, key: int) -> str:
        with open(self.path, "rb") as handle:
            handle.seek(place)
            return json.loads(handle.readline().decode("utf-8"))[self.keys[key]]


def _text(value) -> Optional[str]:
    """``value`` if it is text a tokenizer can take (a string that is valid UTF-8), else None (skipped)."""
    if not isinstance(value, str):
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:   # a lone surrogate from a JSON escape
        return None
    return value


class _Table:
    """A Parquet file, an Arrow file, or a save_to_disk directory: a record's place is its row."""

    def __init__(self, path: Path, keys: Sequence[str]):
        self.path, self.keys = path, keys
        self._lock = threading.Lock()   # the prefetch thread and evaluation may read at once
        self._groups: OrderedDict[int, list] = OrderedDict()
        try:
            self._open()
        except DataError:
            raise
        except ImportError as error:
            raise DataError(f"{path}: reading {self._kind()} needs the {error.name} package (pip install -e "
                            f"'.[datasets]')") from None
        except Exception as error:   # noqa: BLE001 - pyarrow's and datasets' errors name no common base
            raise DataError(f"{path}: cannot be read as {self._kind()} ({_first_line(error)})") from None
        missing = [key for key in keys if key not in self._columns]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (see --json-keys; it has {', '.join(self._columns)})")
        for key in keys:
            kind = str(self._columns[key])
            if kind not in ("string", "large_string", "string_view"):
                raise DataError(f"{path}: column {key!r} holds {kind}, not text (see --json-keys)")

    def _kind(self) -> str:
        return {".parquet": "Parquet", ".arrow": "Arrow"}.get(self.path.suffix, "a datasets.save_to_disk directory")

    def _open(self) -> None:
        import pyarrow as pa   # noqa: PLC0415 - only for text sources

        self._parquet, self._table = None, None
        if self.path.suffix == ".parquet":
            import pyarrow.parquet as pq   # noqa: PLC0415

            self._parquet = pq.ParquetFile(self.path)
            schema = self._parquet.schema_arrow
            self._group_starts = np.cumsum([0] + [self._parquet.metadata.row_group(g).num_rows
                                                  for g in range(self._parquet.num_row_groups)])
        elif self.path.suffix == ".arrow":
            source = pa.memory_map(str(self.path))
            try:
                self._table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:   # save_to_disk writes the stream format
                source.seek(0)
                self._table = pa.ipc.open_stream(source).read_all()
            schema = self._table.schema
        else:
            self._table = _saved_dataset_table(self.path)
            schema = self._table.schema
        self._columns = {field.name: field.type for field in schema}
        self.extent = self._parquet.metadata.num_rows if self._parquet is not None else self._table.num_rows
        self.unit = "rows"

    def records(self) -> Iterator[tuple[int, int, Optional[str]]]:
        if self._parquet is not None:
            batches = self._parquet.iter_batches(batch_size=_BATCH_ROWS, columns=list(self.keys))
        else:
            batches = self._table.select(list(self.keys)).to_batches(max_chunksize=_BATCH_ROWS)
        row = 0
        for batch in batches:
            columns = [batch.column(key).to_pylist() for key in self.keys]
            for i in range(batch.num_rows):
                for k, column in enumerate(columns):
                    yield row + i, k, column[i]
            row += batch.num_rows

    def text(self, place: int, key: int) -> str:
        if self._parquet is None:
            return self._table.column(self.keys[key])[place].as_py()
        group = int(np.searchsorted(self._group_starts, place, side="right")) - 1
        with self._lock:
            if group not in self._groups:
                table = self._parquet.read_row_group(group, columns=list(self.keys))
                self._groups[group] = [table.column(name) for name in self.keys]
                if len(self._groups) > _ROW_GROUPS_KEPT:
                    self._groups.popitem(last=False)
            column = self._groups[group][key]
        return column[place - int(self._group_starts[group])].as_py()


def _saved_dataset_table(path: Path):
    """The Arrow table (memory-mapped) of a ``datasets.Dataset.save_to_disk`` directory, in its row order."""
    import datasets   # noqa: PLC0415 - only for a directory source

    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError as error:
        raise DataError(f"{path}: not a datasets.save_to_disk directory ({_first_line(error)})") from None
    if isinstance(saved, datasets.DatasetDict):
        splits = ", ".join(saved)
        raise DataError(f"{path}: a DatasetDict of splits {splits}: name one split's directory, e.g. "
                        f"{path / next(iter(saved))}")
    return saved.data.table   # save_to_disk writes the rows in order (a selection's indices applied)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class TextSource:
    """The documents of one text source as the sample index reads an IndexedDataset: ``sizes`` (tokens per
    document, EOD included), ``len``, and ``get(document, offset, length)`` (tokenized now)."""

    def __init__(self, path: str, keys: Sequence[str], tokenizer: Tokenizer, cache_dir: Optional[Path],
                 progress: bool = True):
        self.prefix = self.index_path = self.data_path = path
        self.tokenizer = tokenizer
        location = Path(path)
        if not location.exists():
            raise DataError(f"{path}: no such file or directory")
        if location.is_file():
            try:
                open(location, "rb").close()
            except OSError as error:
                raise DataError(f"{path}: cannot be read ({error.strerror or error})") from None
        reader = _JsonLines if location.suffix in JSON_SUFFIXES else _Table
        self.reader = reader(location, list(keys))
        description = {"kind": "TextSource", "version": _INDEX_VERSION, "path": str(location.resolve()),
                       "files": _identity(location), "keys": list(keys), "tokenizer": tokenizer.fingerprint()}
        self.index_md5 = cache_key(description)   # names the sample indices built over these documents

        def build() -> dict[str, np.ndarray]:
            return self._count(progress)

        arrays = load_or_build(cache_dir, f"{location.name}-documents", description, ["places", "keys", "sizes"],
                               build)
        self.places, self.keys, self.sizes = arrays["places"], arrays["keys"], arrays["sizes"]
        if len(self.sizes) == 0:
            raise DataError(f"{path}: no text to train on (every {'/'.join(keys)} is empty or blank)")

    def _count(self, progress: bool) -> dict[str, np.ndarray]:
        """Every document's place, key and token count: the one pass that tokenizes the whole source."""
        # Compact arrays rather than lists of Python ints: a source may hold a hundred million documents.
        places, keys, sizes = array.array("q"), array.array("B"), array.array("i")
        with Progress(self.reader.extent, f"counting the tokens of {Path(self.prefix).name}", self.reader.unit,
                      enabled=progress, log_interval_s=10.0) as bar:
            for place, key, text in self.reader.records():
                size = len(self._encode(text))
                if size:
                    places.append(place)
                    keys.append(key)
                    sizes.append(size)
                bar.set(place)
        return {"places": np.frombuffer(places, dtype=np.int64), "keys": np.frombuffer(keys, dtype=np.uint8),
                "sizes": np.frombuffer(sizes, dtype=np.int32)}

    def _encode(self, text: Optional[str]) -> list[int]:
        """The document's tokens with EOD, as the preprocessor writes them (none for a blank or missing text)."""
        ids = self.tokenizer.encode(text) if text is not None and text.strip() else []
        return ids + [self.tokenizer.eod] if ids else []

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, document: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of ``document`` (to its end without ``length``)."""
        text = self.reader.text(int(self.places[document]), int(self.keys[document]))
        tokens = np.asarray(self._encode(_text(text)), dtype=np.int64)
        if len(tokens) != self.sizes[document]:
            raise DataError(f"{self.prefix}: document {document} has {len(tokens)} tokens, not the "
                            f"{self.sizes[document]} counted: the file changed while it was read")
        return tokens[offset:] if length is None else tokens[offset:offset + length]


def _identity(location: Path) -> list:
    """(name, size, modification time) of the source's files: a changed file is counted again."""
    files = sorted(p for p in location.rglob("*") if p.is_file()) if location.is_dir() else [location]
    return [[str(p.relative_to(location) if location.is_dir() else p.name), p.stat().st_size, p.stat().st_mtime_ns]
            for p in files]
