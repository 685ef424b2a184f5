"""An opened checkpoint: its manifest and DCP index, checked complete before a single tensor is read.

:func:`open_checkpoint` finds the directory ``--load`` means and reads both tables of contents;
:meth:`Checkpoint.verify` then checks, from them alone, that every piece a load will need is there: each parameter's
slices with the right shapes, optimizer ranges that tile each slice, RNG states for every saved rank, and data files
that exist and are not truncated. It is cheap (no tensor data is read) and talks to no other process, so every rank
runs it before any collective and a bad checkpoint stops every rank with the same one-line :class:`CheckpointError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from megalite.checkpoint.directory import find_checkpoint
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.keys import OPTIMIZER_STATES, model_key, optimizer_key, optimizer_pieces, rng_key
from megalite.checkpoint.manifest import Manifest, TensorSpec
from megalite.checkpoint.reshard import coverage_problem
from megalite.checkpoint.storage import check_files, read_metadata, read_tensors, safe_reader, tensor_metadata

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata


@dataclass
class Checkpoint:
    path: Path
    manifest: Manifest
    metadata: Metadata

    def reader(self) -> FileSystemReader:
        return safe_reader(self.path, self.metadata)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return read_tensors(self.reader(), self.metadata, keys)

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
        for state in OPTIMIZER_STATES:
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


def open_checkpoint(load: str | os.PathLike, allow_none: bool = False) -> Optional[Checkpoint]:
    """The checkpoint ``--load`` names, its tables of contents read (None: nothing saved yet and ``allow_none``)."""
    path = find_checkpoint(load, allow_none)
    if path is None:
        return None
    manifest = Manifest.read(path)
    return Checkpoint(path, manifest, read_metadata(path))
