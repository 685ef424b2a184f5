"""The names of the tensors inside a checkpoint: one flat namespace of DCP keys, one key per stored piece.

``torch.distributed.checkpoint`` takes two ranks saving the same key for replicas and keeps one copy, so every piece
gets a key of its own, saying where it came from::

    model/<canonical name>/tp<W>_<r>                        slice r (of W) of a parameter
    optim/<canonical name>/tp<W>_<r>/<lo>-<hi>/<state>      elements [lo, hi) of that slice's flattened optimizer state
    rng/pp<p>_tp<t>_dp<d>/<stream>                          one rank's random-generator state
    fp8/<canonical module name>/<item>                      an FP8 linear's amax history, its scales, its steps

A parameter replicated over tensor-parallel ranks is stored once, as slice 0 of 1. Optimizer states come in pieces
because the distributed optimizer gives each data-parallel rank a contiguous range of the flat gradient buffer, which
may start or end inside a parameter; without it a piece is the whole slice.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

from megalite.tensor_parallel import Partition

OPTIMIZER_STATES = ("main", "exp_avg", "exp_avg_sq")   # fp32 main parameter and AdamW's two moments
MUON_STATES = ("main", "momentum_buffer")   # a matrix stepped by Muon (--optimizer muon): its one buffer

_OPTIMIZER_KEY = re.compile(r"optim/(?P<name>[^/]+)/tp(?P<world>\d+)_(?P<rank>\d+)/(?P<lo>\d+)-(?P<hi>\d+)/"
                            r"(?P<state>\w+)")


def slice_of(partition: Partition, tp_rank: int, tp_world: int) -> tuple[int, int]:
    """(W, r): which stored slice this rank's tensor is. Replicated tensors are one slice, kept by TP rank 0."""
    return (tp_world, tp_rank) if partition.is_sharded else (1, 0)


def stores_slice(partition: Partition, tp_rank: int) -> bool:
    """Whether this TP rank writes its copy (a replicated tensor is written by TP rank 0 only)."""
    return partition.is_sharded or tp_rank == 0


def model_key(name: str, world: int, rank: int) -> str:
    return f"model/{name}/tp{world}_{rank}"


def optimizer_key(name: str, world: int, rank: int, lo: int, hi: int, state: str) -> str:
    return f"optim/{name}/tp{world}_{rank}/{lo}-{hi}/{state}"


def fp8_key(module: str, item: str) -> str:
    """An FP8 delayed-scaling history's piece: the same on every rank holding the layer, so stored once."""
    return f"fp8/{module}/{item}"


def rng_key(pp_rank: int, tp_rank: int, dp_rank: int, stream: str) -> str:
    return f"rng/pp{pp_rank}_tp{tp_rank}_dp{dp_rank}/{stream}"


def optimizer_pieces(keys: Iterable[str]) -> dict[tuple[str, int, int, str], list[tuple[int, int]]]:
    """(name, W, r, state) -> the sorted [lo, hi) ranges stored for it, read off the checkpoint's keys."""
    pieces: dict[tuple[str, int, int, str], list[tuple[int, int]]] = defaultdict(list)
    for key in keys:
        match = _OPTIMIZER_KEY.fullmatch(key)
        if match:
            slot = (match["name"], int(match["world"]), int(match["rank"]), match["state"])
            pieces[slot].append((int(match["lo"]), int(match["hi"])))
    return {slot: sorted(ranges) for slot, ranges in pieces.items()}


def stored_states(pieces: dict[tuple[str, int, int, str], list], name: str) -> tuple[str, ...]:
    """The states a checkpoint stores for parameter ``name`` (from :func:`optimizer_pieces`): Muon's or AdamW's."""
    return MUON_STATES if any(slot[0] == name and slot[3] == "momentum_buffer" for slot in pieces) else OPTIMIZER_STATES
