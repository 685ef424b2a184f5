"""Reading and writing checkpoint tensors through ``torch.distributed.checkpoint`` (DCP), safely.

Writing: one collective ``dcp.save`` over the world (each rank writes its own file of its own pieces; rank 0 writes
DCP's ``.metadata``), or a plain single-process save when the layout has one rank.

Reading: every rank reads what it needs on its own (``no_dist``), so ranks may ask for different keys and no
collective is involved; resharding happens above, on the tensors. Nothing read can run code: DCP loads tensors with
``torch.load(weights_only=True)``, but unpickles ``.metadata`` with plain pickle, so :class:`SafeReader` replaces that
with an unpickler that only builds DCP's own metadata classes. Before any read, :func:`check_files` confirms that
every file the metadata points into exists and is long enough, so a truncated or partial checkpoint is reported as
one line naming the file instead of failing deep inside torch.
"""

from __future__ import annotations

import functools
import os
import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megalite.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader, metadata as dcp_metadata

METADATA_NAME = ".metadata"


def _dcp():
    """torch.distributed.checkpoint, imported on first use: it pulls in DTensor and sympy (about a second), which a
    run that neither saves nor loads should not pay for at start-up."""
    import torch.distributed.checkpoint as dcp   # (its .metadata, .api and filesystem come with it)
    return dcp


@functools.cache
def _allowed_classes() -> dict[tuple[str, str], object]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    m = _dcp().metadata
    allowed = {(cls.__module__, cls.__qualname__): cls for cls in (
        m.Metadata, m.TensorStorageMetadata, m.BytesStorageMetadata, m.ChunkStorageMetadata, m.TensorProperties,
        m.MetadataIndex, m.StorageMeta, m._MEM_FORMAT_ENCODING, _StorageInfo, torch.Size, Path, type(Path()))}
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout   # a layout by its name
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata objects, torch dtypes/layouts/sizes and paths: any other global is refused."""

    def find_class(self, module: str, name: str):
        allowed = _allowed_classes()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which checkpoint metadata may not contain")


def read_metadata(directory: Path) -> dcp_metadata.Metadata:
    path = directory / METADATA_NAME
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a complete checkpoint: {METADATA_NAME} (DCP's index) is missing")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as error:   # truncated or hostile: EOFError, UnpicklingError, ...
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {error})") from None
    m = _dcp().metadata
    if not isinstance(metadata, m.Metadata) or metadata.storage_data is None:
        raise CheckpointError(f"{path}: not DCP checkpoint metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = m.StorageMeta()
    return metadata


@functools.cache
def _safe_reader_class() -> type:
    class SafeReader(_dcp().FileSystemReader):
        """DCP's file reader with :func:`read_metadata` in place of its plain-pickle one (read once, then reused)."""

        def __init__(self, directory: Path, metadata: Optional[dcp_metadata.Metadata] = None):
            super().__init__(directory)
            self.directory = Path(directory)
            self._metadata = metadata

        def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
            if self._metadata is None:
                self._metadata = read_metadata(self.directory)
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

    return SafeReader


def safe_reader(directory: Path, metadata: Optional[dcp_metadata.Metadata] = None) -> FileSystemReader:
    """A DCP reader of ``directory`` that unpickles its metadata safely (see :func:`read_metadata`)."""
    return _safe_reader_class()(directory, metadata)


def check_files(directory: Path, metadata: dcp_metadata.Metadata) -> None:
    """Every data file the metadata points into exists and holds at least the bytes it should."""
    needed: dict[str, tuple[int, str]] = {}
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (0, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for relative_path, (size, key) in sorted(needed.items()):
        path = directory / relative_path
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (it holds {key}, among others)") from None
        if actual < size:
            raise CheckpointError(f"{path}: truncated ({actual} of at least {size} bytes)")


def tensor_metadata(metadata: dcp_metadata.Metadata, key: str) -> Optional[dcp_metadata.TensorStorageMetadata]:
    """The stored tensor's metadata, or None when the key is absent or is not a plain tensor (DCP would unpickle
    a non-tensor entry with ``weights_only=False``; we never ask for one)."""
    item = metadata.state_dict_metadata.get(key)
    return item if isinstance(item, _dcp().metadata.TensorStorageMetadata) else None


def read_tensors(reader: FileSystemReader, metadata: dcp_metadata.Metadata,
                 keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors stored under ``keys``, on the CPU in their stored dtype (no collective: this rank alone)."""
    targets = {}
    for key in keys:
        item = tensor_metadata(metadata, key)
        if item is None:
            raise CheckpointError(f"{reader.directory}: no tensor {key}")
        targets[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    if not targets:
        return {}
    dcp = _dcp()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(targets, storage_reader=reader, no_dist=True)
    except (Exception, dcp.api.CheckpointException) as error:   # the latter is a BaseException
        raise CheckpointError(f"{reader.directory}: reading {keys[0]} failed ({_reason(error)})") from None
    return targets


def _reason(error: BaseException) -> str:
    if isinstance(error, _dcp().api.CheckpointException):   # DCP wraps each rank's exception with its traceback
        for exc, _trace in error.failures.values():
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def write_tensors(directory: Path, tensors: dict[str, torch.Tensor], collective: bool) -> None:
    """Save ``tensors`` (this rank's pieces, keys unique across ranks) into ``directory``. ``collective``: every
    rank of the world calls this together and DCP writes one index of all of them; else this process alone."""
    dcp = _dcp()
    writer = dcp.FileSystemWriter(os.fspath(directory))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(tensors, storage_writer=writer, no_dist=not collective)
    except dcp.api.CheckpointException as error:   # a BaseException: an ordinary error with its first reason
        raise RuntimeError(f"saving the checkpoint into {directory} failed ({_reason(error)})") from None


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
