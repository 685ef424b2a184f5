"""How each parameter is cut from its full tensor, and layout-independent initialization.

Every parameter carries three attributes set by the layer that owns it:

- ``full_shape``: the shape of the canonical, unpadded tensor a single-process model would hold;
- ``partition``: a :class:`Partition` saying how this rank's tensor is cut from it;
- ``init_fn``: fills a full tensor in place, given a ``torch.Generator``;

and, optionally, ``sequence_parallel = True``: a parameter replicated over TP but applied to this rank's sequence
shard only (norms, biases and position embeddings under sequence parallelism), whose gradient is therefore a partial
sum that the data-parallel engine adds up over TP.

:func:`initialize_parameters` draws each full tensor on the CPU from a generator seeded by (seed, canonical name)
and keeps this rank's slice. The full weights are thus the same bits whatever TP/PP/DP is, which is what lets every
parallel run be compared step by step with the single-process run. (Drawing full tensors costs time for huge
models; Megatron's --use-cpu-initialization pays the same price for the same guarantee.) Checkpoint resharding
uses the same description to merge and re-split tensors.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch


@dataclass(frozen=True)
class Partition:
    """Where a local tensor sits in the full one. ``dim=None`` means replicated on every tensor-parallel rank.

    ``fused`` says the full tensor stacks blocks along ``dim``, each split over TP separately so a rank gets its
    slice of every block: an int is that many equal blocks (QKV: 3, SwiGLU's [gate; up]: 2), a tuple gives the
    block sizes (grouped-query attention's [q; k; v] is (hidden, groups x head dim, groups x head dim))."""
    dim: Optional[int] = None
    fused: int | tuple[int, ...] = 1
    padded_size: Optional[int] = None   # zero-pad the full tensor along dim to this size first (vocab padding)

    @property
    def is_sharded(self) -> bool:
        return self.dim is not None

    def block_sizes(self, size: int) -> list[int]:
        """Sizes along ``dim`` of the blocks of a (padded) full tensor of that size."""
        if isinstance(self.fused, tuple):
            if sum(self.fused) != size:
                raise ValueError(f"fused blocks {self.fused} do not add up to dimension {size}")
            return list(self.fused)
        if size % self.fused:
            raise ValueError(f"dimension {size} cannot be split into {self.fused} equal blocks")
        return [size // self.fused] * self.fused


REPLICATED = Partition()


def local_shape(full_shape: tuple[int, ...], partition: Partition, world: int) -> tuple[int, ...]:
    if not partition.is_sharded:
        return tuple(full_shape)
    shape = list(full_shape)
    size = partition.padded_size or shape[partition.dim]
    if any(block % world for block in partition.block_sizes(size)):
        raise ValueError(f"dimension {size} cannot be split into {world} x {partition.fused} parts")
    shape[partition.dim] = size // world
    return tuple(shape)


def shard(full: torch.Tensor, partition: Partition, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of ``full`` (padded first when the partition asks for it)."""
    if not partition.is_sharded:
        return full
    dim = partition.dim
    if partition.padded_size is not None and partition.padded_size > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = partition.padded_size - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    blocks = full.split(partition.block_sizes(full.shape[dim]), dim=dim)
    return torch.cat([block.chunk(world, dim=dim)[rank] for block in blocks], dim=dim)


def unshard(parts: list[torch.Tensor], partition: Partition, full_size: Optional[int] = None) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from every rank's slice, padding removed when ``full_size`` is given."""
    if not partition.is_sharded:
        return parts[0]
    dim = partition.dim
    world = len(parts)
    local_blocks = [size // world for size in partition.block_sizes(parts[0].shape[dim] * world)]
    per_rank_blocks = [p.split(local_blocks, dim=dim) for p in parts]
    full = torch.cat([torch.cat([blocks[i] for blocks in per_rank_blocks], dim=dim)
                      for i in range(len(local_blocks))], dim=dim)
    if full_size is not None:
        full = full.narrow(dim, 0, full_size)
    return full


def mark(param: torch.nn.Parameter, full_shape: tuple[int, ...], partition: Partition,
         init_fn: Callable[[torch.Tensor, torch.Generator], None]) -> torch.nn.Parameter:
    """Attach the sharding description and initializer to a parameter (returns it for chaining)."""
    param.full_shape = tuple(full_shape)
    param.partition = partition
    param.init_fn = init_fn
    return param


def _normal(tensor: torch.Tensor, generator: torch.Generator, std: float) -> None:
    tensor.normal_(0.0, std, generator=generator)


def normal_init(std: float) -> Callable[[torch.Tensor, torch.Generator], None]:
    return functools.partial(_normal, std=std)


def zeros_init(tensor: torch.Tensor, generator: torch.Generator) -> None:
    tensor.zero_()


def ones_init(tensor: torch.Tensor, generator: torch.Generator) -> None:
    tensor.fill_(1.0)


def parameter_seed(seed: int, name: str) -> int:
    """A per-parameter seed that depends only on the run's seed and the parameter's canonical name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def initialize_parameters(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], seed: int,
                          tp_rank: int, tp_world: int) -> None:
    """Fill each parameter with its slice of a full tensor drawn from (seed, canonical name)."""
    for name, param in named_parameters:
        if param.is_meta:   # a simulated GPU's (megalite.simulation): shapes only, no values to draw
            continue
        full = torch.empty(param.full_shape, dtype=torch.float32)
        param.init_fn(full, torch.Generator().manual_seed(parameter_seed(seed, name)))
        param.copy_(shard(full, param.partition, tp_rank, tp_world))
