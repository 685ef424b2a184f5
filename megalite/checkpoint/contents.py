"""An opened checkpoint: its manifest and DCP index, checked complete before a single tensor is read.

:func:`open_checkpoint` finds the directory ``--load`` means and reads both tables of contents, each checked against
its digest (the manifest's own, then the index's from the manifest); :meth:`Checkpoint.verify` then checks, from them
alone, that every piece a load will need is there: each parameter's slices with the right shapes, optimizer ranges
that tile each slice, RNG states for every saved rank, and data files that exist and are not truncated. It is cheap
(no tensor data is read) and talks to no other process, so every rank runs it before any collective and a bad
checkpoint stops every rank with the same one-line :class:`CheckpointError`.

:meth:`Checkpoint.verify_contents` hashes the stored bytes of given items and compares them with the digests of the
save; :meth:`Checkpoint.read` does so for any item not verified yet before deserializing it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from megalite.checkpoint.digests import digest_file, digest_ranges
from megalite.checkpoint.directory import find_checkpoint
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.keys import model_key, optimizer_key, optimizer_pieces, rng_key, stored_states
from megalite.checkpoint.manifest import Manifest, TensorSpec
from megalite.checkpoint.reshard import coverage_problem
from megalite.checkpoint.storage import check_files, read_metadata, read_tensors, safe_reader, tensor_metadata
from megalite.config import CheckpointConfig

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata


NO_DIGESTS = ("the checkpoint has no digests (saved before megalite recorded them): its contents were not "
              "verified")


@dataclass
class Checkpoint:
    path: Path
    manifest: Manifest
    metadata: Metadata
    _verified: set[str] = dataclasses.field(default_factory=set, repr=False)   # keys whose bytes matched

    def reader(self) -> FileSystemReader:
        return safe_reader(self.path, self.metadata)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The tensors under ``keys``, each item's bytes checked against its digest first (once per item)."""
        self.verify_contents([key for key in keys if key not in self._verified])
        return read_tensors(self.reader(), self.metadata, keys)

    @property
    def has_digests(self) -> bool:
        return self.manifest.digests is not None

    @functools.cached_property
    def _locations(self) -> dict[str, tuple[str, int, int]]:
        """key -> (data file relative to the checkpoint, offset, length) of its stored bytes."""
        return {index.fqn: (info.relative_path, info.offset, info.length)
                for index, info in self.metadata.storage_data.items()}

    def item_sizes(self, keys: list[str]) -> list[int]:
        return [self._locations[key][2] if key in self._locations else 0 for key in keys]

    def in_storage_order(self, keys) -> list[str]:
        """``keys`` sorted by data file and offset (the order to read them in)."""
        return sorted(keys, key=lambda key: self._locations.get(key, ("", 0, 0))[:2])

    def verify_contents(self, keys: list[str]) -> None:
        """Raise CheckpointError naming the data file and the first item among ``keys`` whose stored bytes differ
        from their digest (nothing to check in a checkpoint without digests)."""
        digests = self.manifest.digests
        if digests is None or not keys:
            return
        by_file = defaultdict(list)
        for key in keys:
            if key not in self._locations:
                raise CheckpointError(f"{self.path}: no tensor {key}")
            relative_path, offset, length = self._locations[key]
            by_file[relative_path].append((key, offset, length))
        for relative_path, items in sorted(by_file.items()):
            path = self.path / relative_path
            try:
                actual = digest_ranges(path, sorted(items, key=lambda item: item[1]), digests.algorithm)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing (it holds {items[0][0]}, among others)") from None
            for key, _, _ in sorted(items, key=lambda item: item[1]):
                if key not in digests.items:
                    raise CheckpointError(f"{path}: the manifest has no digest of {key}")
                if actual[key] != digests.items[key]:
                    raise CheckpointError(f"{path}: checksum mismatch in {key}")
        self._verified.update(keys)

    def mark_verified(self, keys) -> None:
        """Record ``keys`` as checked (by other ranks, which verify a checkpoint together: see load.py)."""
        self._verified.update(keys)

    def verify_files(self, names) -> None:
        """Check the files ``names`` (tokenizer files, stored whole beside the tensors) against their digests."""
        digests = self.manifest.digests
        for name in (names if digests is not None else []):
            path = self.path / name
            if name not in digests.files:
                raise CheckpointError(f"{path}: the manifest has no digest of it")
            try:
                actual = digest_file(path, digests.algorithm)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing") from None
            if actual != digests.files[name]:
                raise CheckpointError(f"{path}: checksum mismatch")

    def verify(self, optimizer: bool = False, rng: bool = False) -> None:
        """Raise CheckpointError naming the first missing or malformed piece (see the module docstring)."""
        check_files(self.path, self.metadata)
        pieces = optimizer_pieces(self.metadata.state_dict_metadata) if optimizer else {}
        for name, spec in self.manifest.params.items():
            for rank, shape in enumerate(spec.slice_shapes()):
                self._expect(model_key(name, spec.slices, rank), shape, spec.torch_dtype)
                if optimizer and spec.optimized:
                    self._verify_optimizer_slice(name, spec, rank, shape, pieces)
        if rng:
            for p, t, d in self.manifest.layout.ranks():
                for stream in self.manifest.rng_streams:
                    if tensor_metadata(self.metadata, rng_key(p, t, d, stream)) is None:
                        raise CheckpointError(f"{self.path}: incomplete checkpoint: no tensor "
                                              f"{rng_key(p, t, d, stream)} (--no-load-rng skips RNG states)")

    def _verify_optimizer_slice(self, name: str, spec: TensorSpec, rank: int, shape: tuple[int, ...],
                                pieces: dict) -> None:
        numel = int(torch.Size(shape).numel())
        for state in stored_states(pieces, name):
            ranges = pieces.get((name, spec.slices, rank, state), [])
            problem = coverage_problem(ranges, numel) if ranges else "no pieces at all"
            if problem is not None:
                raise CheckpointError(f"{self.path}: incomplete checkpoint: optimizer state {state} of {name} "
                                      f"(TP slice {rank} of {spec.slices}): {problem} (--no-load-optim skips "
                                      f"optimizer state)")
            for lo, hi in ranges:
                self._expect(optimizer_key(name, spec.slices, rank, lo, hi, state), (hi - lo,), torch.float32)

    def _expect(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        item = tensor_metadata(self.metadata, key)
        if item is None:
            raise CheckpointError(f"{self.path}: incomplete checkpoint: no tensor {key}")
        if tuple(item.size) != tuple(shape) or item.properties.dtype != dtype:
            raise CheckpointError(f"{self.path}: tensor {key} is {item.properties.dtype} {list(item.size)}, "
                                  f"the manifest says {dtype} {list(shape)}")


def open_load_checkpoint(c: CheckpointConfig) -> Optional[Checkpoint]:
    """The checkpoint ``--load`` names; None when ``--load`` is ``--save`` and nothing is saved there yet."""
    same = c.save is not None and os.path.abspath(c.load) == os.path.abspath(c.save)
    return open_checkpoint(c.load, allow_none=same)


def open_checkpoint(load: str | os.PathLike, allow_none: bool = False) -> Optional[Checkpoint]:
    """The checkpoint ``--load`` names, its tables of contents read (None: nothing saved yet and ``allow_none``)."""
    path = find_checkpoint(load, allow_none)
    if path is None:
        return None
    manifest = Manifest.read(path)
    digests = manifest.digests
    return Checkpoint(path, manifest, read_metadata(path, digests and digests.index, digests and digests.algorithm))
