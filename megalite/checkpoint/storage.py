"""Reading and writing checkpoint tensors through ``torch.distributed.checkpoint`` (DCP), safely.

Writing: one collective ``dcp.save`` over the world (each rank writes its own file of its own pieces; rank 0 writes
DCP's ``.metadata``), or a plain single-process save when the layout has one rank; or the same through
``dcp.async_save``, which copies the tensors (staging) and writes them in a background thread while training goes on,
over a gloo group of its own (collectives of the training thread and of the writing thread must not share a group).
Each rank hashes the items it wrote (:class:`DigestingWriter`) and the digests travel with DCP's own write results
to rank 0, which records them in the manifest (:mod:`megalite.checkpoint.digests`).

Reading: every rank reads what it needs on its own (``no_dist``), so ranks may ask for different keys and no
collective is involved; resharding happens above, on the tensors. Nothing read can run code: DCP loads tensors with
``torch.load(weights_only=True)``, but unpickles ``.metadata`` with plain pickle, so :class:`SafeReader` replaces that
with an unpickler that only builds DCP's own metadata classes. Before any read, :func:`check_files` confirms that
every file the metadata points into exists and is long enough, so a truncated or partial checkpoint is reported as
one line naming the file instead of failing deep inside torch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import os
import pickle
import warnings
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.checkpoint.digests import default_algorithm, digest_bytes, digest_file, digest_ranges
from megalite.checkpoint.errors import CheckpointError, SaveError

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


def read_metadata(directory: Path, digest: Optional[str] = None, algorithm: Optional[str] = None
                  ) -> dcp_metadata.Metadata:
    """DCP's index of ``directory``, checked against ``digest`` (of ``algorithm``) before it is unpickled."""
    path = directory / METADATA_NAME
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a complete checkpoint: {METADATA_NAME} (DCP's index) is missing")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    if digest is not None and digest_bytes(data, algorithm) != digest:
        raise CheckpointError(f"{path}: checksum mismatch (DCP's index changed since it was saved)")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
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


@dataclasses.dataclass(frozen=True)
class _Digested:
    """One item's storage info and the digest of its bytes, on their way from the writing rank to the coordinator."""
    info: object
    digest: str


@functools.cache
def _digesting_writer_class() -> type:
    class DigestingWriter(_dcp().FileSystemWriter):
        """DCP's file writer that hashes each item's bytes right after writing its file (on the writing rank, from
        the page cache, all ranks at once); the coordinator's ``finish`` collects every rank's digests from the
        write results DCP gathers anyway, then hashes the index it writes. One item per key: megalite's keys are
        unique and each holds one plain tensor."""

        def __init__(self, directory: Path, algorithm: str):
            super().__init__(os.fspath(directory))
            self.directory, self.algorithm = Path(directory), algorithm
            self.digests: dict[str, str] = {}       # on the coordinator, after finish
            self.index_digest: Optional[str] = None

        def write_data(self, plan, planner):
            results = super().write_data(plan, planner).wait()
            ranges = defaultdict(list)
            for result in results:
                info = result.storage_data
                ranges[info.relative_path].append((result.index.fqn, info.offset, info.length))
            digests = {}
            for relative_path, items in ranges.items():
                digests.update(digest_ranges(self.directory / relative_path, items, self.algorithm))
            future = torch.futures.Future()
            future.set_result([dataclasses.replace(r, storage_data=_Digested(r.storage_data, digests[r.index.fqn]))
                               for r in results])
            return future

        def finish(self, metadata, results) -> None:
            plain = []
            for rank_results in results:
                self.digests.update({r.index.fqn: r.storage_data.digest for r in rank_results})
                plain.append([dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank_results])
            super().finish(metadata, plain)
            self.index_digest = digest_file(self.directory / METADATA_NAME, self.algorithm)

    return DigestingWriter


class TensorWrite:
    """This rank's part of one DCP save: finished (synchronous) or running in the background (asynchronous). On
    rank 0 (DCP's coordinator), once finished, ``digests`` and ``index_digest`` hold every rank's digests."""

    def __init__(self, directory: Path, writer, future=None, group: Optional[dist.ProcessGroup] = None):
        self.directory, self._writer, self._future, self._group = directory, writer, future, group

    @property
    def algorithm(self) -> str:
        return self._writer.algorithm

    @property
    def digests(self) -> dict[str, str]:
        return self._writer.digests

    @property
    def index_digest(self) -> Optional[str]:
        return self._writer.index_digest

    def done(self) -> bool:
        """Whether this rank's part has finished (no collective)."""
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Block until this rank's part is written; a failure on any rank raises here on every rank (DCP gathers
        each rank's outcome before it writes the index)."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        except (Exception, _dcp().api.CheckpointException) as error:   # the latter is a BaseException
            raise SaveError(f"saving the checkpoint into {self.directory} failed ({_reason(error)})",
                            str(self.directory)) from None
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None


def write_tensors(directory: Path, tensors: dict[str, torch.Tensor], collective: bool,
                  asynchronous: bool = False) -> TensorWrite:
    """Save ``tensors`` (this rank's pieces, keys unique across ranks) into ``directory``. ``collective``: every
    rank of the world calls this together and DCP writes one index of all of them; else this process alone.
    ``asynchronous``: return once the tensors are copied, the write going on in the background (``wait`` on it)."""
    dcp = _dcp()
    writer = _digesting_writer_class()(directory, default_algorithm())
    alone_in_a_world = not collective and dist.is_initialized()
    if asynchronous and not collective:
        # The single-process notice comes from the writing thread, where a local filter would not reach.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
    if asynchronous and alone_in_a_world and "no_dist" in inspect.signature(dcp.async_save).parameters:
        # One rank's layout inside a larger world (tests do this): DCP must not reach for the world's group.
        return TensorWrite(directory, writer, dcp.async_save(tensors, storage_writer=writer, no_dist=True))
    if asynchronous and not alone_in_a_world:   # (an older torch writes a lone rank's save synchronously)
        group = _writing_group() if collective else None
        return TensorWrite(directory, writer, dcp.async_save(tensors, storage_writer=writer, process_group=group),
                           group)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(tensors, storage_writer=writer, no_dist=not collective)
    except dcp.api.CheckpointException as error:   # a BaseException: an ordinary error with its first reason
        raise SaveError(f"saving the checkpoint into {directory} failed ({_reason(error)})", str(directory)) from None
    return TensorWrite(directory, writer)


def _writing_group() -> dist.ProcessGroup:
    """A gloo group of the whole world for one background save (its collectives run beside the training thread's,
    which use other groups; async_save also needs a CPU backend, which an NCCL world lacks)."""
    return dist.new_group(list(range(dist.get_world_size())), timeout=parallel_state.world_timeout(), backend="gloo")


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
