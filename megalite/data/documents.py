"""Raw text documents from the inputs of the tokenizer trainer and the preprocessor.

An input is a file or a directory (walked recursively in sorted order, hidden entries and ``__pycache__`` skipped).
A ``.jsonl``/``.json`` file holds one JSON object per line and each of ``json_keys`` gives one document; any other
file is plain text with one document per line, or one per file with ``whole_files`` (for source code, where lines
are not documents). Empty lines and documents of only whitespace are skipped, not fatal. Files are streamed a line
at a time, so an input may be larger than memory (except a whole file taken as one document); the iterable knows how
many bytes of the inputs it has read of how many (``bytes_read``, ``total_bytes``), for progress bars.

A bad JSON record is skipped with a warning on stderr naming its file and line, and counted (``skipped_records``,
which the tools' summaries report), when it is one damaged record among good ones: a line that is not a JSON object
(cut short, corrupt), a ``null`` or non-string value under a key, a string holding a lone UTF-16 surrogate
(``"\\ud800"``: valid JSON, but no UTF-8 text, so no tokenizer can take it). Megatron's preprocessor stops at the
first with a traceback; a corpus of millions of records is better served by the summary. It stops instead, with one
line naming the file and line, where the options or the file are wrong rather than a record: a key of --json-keys
missing from a record, a first record that is not a JSON object (the file is not JSON lines: a pretty-printed
``.json`` would otherwise be skipped line by line), a line that is not UTF-8.
"""

from __future__ import annotations

import codecs
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from megalite.data.errors import DataError

JSON_SUFFIXES = (".jsonl", ".json")


def input_files(inputs: Sequence[str]) -> list[tuple[Path, bool]]:
    """(file, named explicitly) for every input; a missing input is an error."""
    files: list[tuple[Path, bool]] = []
    for name in inputs:
        path = Path(name)
        if path.is_file():
            files.append((path, True))
        elif path.is_dir():
            for child in sorted(path.rglob("*")):
                parts = child.relative_to(path).parts
                if child.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in parts):
                    files.append((child, False))
        else:
            raise DataError(f"{path}: input not found")
    return files


def _looks_like_text(path: Path) -> bool:
    """Whether a file met while walking a directory is text: its first 8 KiB are NUL-free UTF-8."""
    with open(path, "rb") as handle:
        head = handle.read(8192)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at 8 KiB is fine
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def _lines(path: Path, on_read: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file, streamed (inputs can be larger than memory). Lines end at b"\n" only
    (not at U+2028 and friends, which may sit inside a JSON string); a CR before it goes too. ``on_read(bytes)``
    after each line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            on_read(len(raw))
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{number}: not UTF-8 text") from None
            yield number, line.removesuffix("\n").removesuffix("\r")


def _json_documents(path: Path, json_keys: Sequence[str], on_read: Callable[[int], None],
                    skip: Callable[[str], None]) -> Iterator[str]:
    """The documents of a JSON-lines file; ``skip(where_and_why)`` for each bad record passed over (see the module
    docstring for which are skipped and which stop)."""
    records = 0
    for number, line in _lines(path, on_read):
        if not line.strip():
            continue
        records += 1
        try:
            record = json.loads(line)
            reason = None if isinstance(record, dict) else "not a JSON object"
        except (ValueError, RecursionError) as error:   # bad JSON, an integer too long, nesting too deep
            reason = f"not a JSON object ({getattr(error, 'msg', error)})"
        if reason is not None:
            if records == 1:
                raise DataError(f"{path}:{number}: {reason}; a .jsonl/.json input holds one JSON object per line")
            skip(f"{path}:{number}: {reason}")
            continue
        for key in json_keys:
            if key not in record:
                raise DataError(f"{path}:{number}: no key {key!r} (see --json-keys)")
            value = record[key]
            if not isinstance(value, str):
                skip(f"{path}:{number}: {key!r} is {'null' if value is None else 'a ' + type(value).__name__}, "
                     f"not a string")
                continue
            if "\\u" in line:   # only an escape can make a lone surrogate (the line itself was valid UTF-8)
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as error:
                    skip(f"{path}:{number}: {key!r} holds a lone surrogate ({value[error.start]!r}), which is not "
                         f"text")
                    continue
            yield value


class Documents:
    """Every non-blank document of the inputs, in input order (iterate it once), and how far the reading is."""

    def __init__(self, inputs: Sequence[str], json_keys: Sequence[str] = ("text",), whole_files: bool = False):
        self.files = input_files(inputs)
        self.json_keys, self.whole_files = json_keys, whole_files
        self.total_bytes = sum(path.stat().st_size for path, _ in self.files)
        self.bytes_read = 0
        self.skipped_records = 0   # bad JSON records passed over, each named on stderr

    def _read(self, size: int) -> None:
        self.bytes_read += size

    def _skip(self, where_and_why: str) -> None:
        self.skipped_records += 1
        print(f"megalite: skipping {where_and_why}", file=sys.stderr)

    def __iter__(self) -> Iterator[str]:
        for path, explicit in self.files:
            if not explicit and not _looks_like_text(path):
                # A binary file met while walking a directory (an image, a .pyc) is not text for us: skip it.
                print(f"megalite: skipping {path}: not UTF-8 text", file=sys.stderr)
                self._read(path.stat().st_size)
                continue
            if path.suffix in JSON_SUFFIXES:
                documents: Iterable[str] = _json_documents(path, self.json_keys, self._read, self._skip)
            elif self.whole_files:
                try:
                    documents = [path.read_bytes().decode("utf-8")]
                except UnicodeDecodeError as error:
                    raise DataError(f"{path}: not UTF-8 text (byte {error.start})") from None
                self._read(path.stat().st_size)
            else:
                documents = (line for _, line in _lines(path, self._read))
            for document in documents:
                if document.strip():
                    yield document


def iter_documents(inputs: Sequence[str], json_keys: Sequence[str] = ("text",),
                   whole_files: bool = False) -> Documents:
    """Every non-blank document of the inputs, in input order (a missing input raises DataError here)."""
    return Documents(inputs, json_keys, whole_files)
