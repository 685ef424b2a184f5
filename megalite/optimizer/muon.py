"""Muon for the hidden matrices: momentum, orthogonalized by Newton-Schulz iterations, over TP and DP shards.

One update of an m x n weight W with gradient G (Keller Jordan's Muon; Moonlight's scale; torch.optim.Muon's maths):

    B <- B + (1 - mu) (G - B)                    (the momentum buffer; Nesterov uses G + mu (B - G) below)
    O <- NS_k(B / ||B||_F)                        k quintic Newton-Schulz steps X <- aX + (bA + cA^2) X, A = X X^T,
                                                  (a, b, c) = (3.4445, -4.7750, 2.0315): U S' V^T, S' ~ 1
    W <- W (1 - lr wd) - lr * scale(m, n) * extra * O

scale is sqrt(max(m, n)) (``spectral``), sqrt(max(1, m/n)) or sqrt(m/n); with ``extra`` 0.2, spectral gives O the RMS
of an AdamW update (Moonlight), so AdamW's learning rate and weight decay carry over. NS is written here rather than
taken from ``torch.optim.Muon`` (torch >= 2.9): torch's runs in bf16 on a whole matrix only, and the work here is the
shards. It runs in fp32.

A matrix that tensor parallelism splits along rows (column-parallel) or columns (row-parallel) is orthogonalized as
``--muon-tp-mode`` says:
- ``duplicated``: the TP ranks all-gather the whole update, each orthogonalizes it and keeps its shard (the single
  process's result; k NS steps on the whole matrix on every rank);
- ``distributed``: NS on the shards: the Gram matrix of the unsplit side (X^T X for a row split, X X^T for a column
  split; each shard's part summed over TP, one all-reduce per step) is whole on every rank, and each rank updates its
  shard with it: the single process's result up to rounding, with 1/TP of the products of the long side;
- ``blockwise``: each shard orthogonalized on its own and scaled by its own shape (no communication; the result
  depends on TP).
NS commutes with permuting rows or columns, so a fused weight's shards (each rank holding its slice of every block)
may be gathered in rank order. The query/key/value weight (``is_qkv``) is three matrices, q, k and v, each
orthogonalized and scaled alone, unless ``--muon-no-split-qkv``. A routed expert's weight is its own matrix.

Under the distributed optimizer (ZeRO-1/2) a rank holds only its flat shard of each bucket, cutting matrices anywhere.
The momentum is elementwise, so it stays sharded like Adam's moments; only NS needs whole matrices. Each matrix is
assigned whole to one DP rank (greedily by size, the same on every rank: Megatron's layer-wise dist_muon); per bucket,
the ranks all-gather the momentum updates, each owner orthogonalizes its matrices, and a reduce-scatter of the results
(zero elsewhere) hands each rank its shard of them. That is an all-reduce's traffic per bucket of matrices, and 1/DP
of the NS work per rank.

Under ZeRO-3 (FSDP2) a rank holds a row shard of every parameter (a DTensor over the data-parallel mesh, or the
expert-data-parallel one for routed experts). The momentum stays sharded as above, and the matrices are assigned to
the mesh's ranks as above; but since every row of a matrix has a known home (FSDP2 cuts rows like torch.chunk), the
pieces travel straight to their owner: one ``all_to_all_single`` sends each rank's rows of the momentum updates to the
matrices' owners, the owners orthogonalize, and a second one sends each rank its rows of the results. A rank sends
about N(D-1)/D^2 elements each way (N: the matrices' size, D: the mesh's size) instead of the N(D-1)/D of an
all-gather and a reduce-scatter, and holds at most its owned matrices whole (~N/D) beside the two buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megalite import parallel_state
from megalite.config import OptimizerConfig
from megalite.distributed.data_parallel import DataParallel
from megalite.distributed.fully_sharded import row_range
from megalite.parallel_state import GroupInfo

QUINTIC = (3.4445, -4.7750, 2.0315)   # Keller Jordan's coefficients, as torch.optim.Muon's
EPS = 1e-7

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_muon_matrix(param: torch.nn.Parameter) -> bool:
    """What Muon steps: 2-D weights other than the embeddings and the output layer (Moonlight's split)."""
    return (param.dim() == 2 and not getattr(param, "is_embedding_or_output", False)
            and not getattr(param, "is_position_embedding", False))


def scale_factor(rows: int, cols: int, mode: str) -> float:
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    return math.sqrt(rows / cols)   # unit_rms_norm


def newton_schulz(x: torch.Tensor, steps: int, split_dim: Optional[int] = None,
                  group: Optional[GroupInfo] = None) -> torch.Tensor:
    """The orthogonalized ``x`` (k quintic steps, fp32). With ``split_dim`` and ``group``: ``x`` is this rank's
    shard of a matrix split along that dimension over the group, and the result is this rank's shard of NS of the
    whole matrix (the norm and each Gram matrix summed over the group)."""
    a, b, c = QUINTIC
    x = x.float()
    sharded = split_dim is not None and group is not None and group.size > 1
    norm = x.square().sum()
    if sharded:
        group.sum(norm)
    x = x / norm.sqrt().clamp(min=EPS)
    # The Gram matrix of the side that is whole on this rank (unsplit: the smaller one, as torch.optim.Muon's).
    left = split_dim == 1 if sharded else x.size(0) <= x.size(1)
    for _ in range(steps):
        gram = x @ x.T if left else x.T @ x
        if sharded:
            group.sum(gram)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a) if left else torch.addmm(x, x, poly, beta=a)
    return x


def _tensor_group(param: torch.nn.Parameter) -> GroupInfo:
    return (parallel_state.get_expert_tensor_parallel_group() if getattr(param, "is_expert", False)
            else parallel_state.get_tensor_model_parallel_group())


@dataclass(frozen=True)
class MuonSettings:
    """The options of one run's Muon (OptimizerConfig's muon_* fields)."""
    momentum: float = 0.95
    nesterov: bool = False
    steps: int = 5
    scale_mode: str = "spectral"
    extra_scale: float = 0.2
    tp_mode: str = "duplicated"
    split_qkv: bool = True

    @classmethod
    def from_config(cls, cfg: OptimizerConfig) -> MuonSettings:
        return cls(cfg.muon_momentum, cfg.muon_use_nesterov, cfg.muon_num_ns_steps, cfg.muon_scale_mode,
                   cfg.muon_extra_scale_factor, cfg.muon_tp_mode, not cfg.muon_no_split_qkv)

    def orthogonalize(self, update: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
        """The scaled orthogonal update of this rank's ``update`` (shaped as ``param``, this rank's TP slice)."""
        partition = getattr(param, "partition", None)
        group = _tensor_group(param) if partition is not None and partition.is_sharded else None
        split = partition.dim if group is not None and group.size > 1 else None
        full_shape = getattr(param, "full_shape", tuple(param.shape))
        if self.split_qkv and getattr(param, "is_qkv", False):
            blocks = partition.block_sizes(full_shape[0]) if partition is not None else [full_shape[0]]
            world = group.size if split == 0 else 1
            local = update.split([size // world for size in blocks], dim=0)
            return torch.cat([self._one(piece, (size, full_shape[1]), split, group)
                              for piece, size in zip(local, blocks)], dim=0)
        return self._one(update, full_shape, split, group)

    def _one(self, update: torch.Tensor, full_shape: tuple[int, int], split: Optional[int],
             group: Optional[GroupInfo]) -> torch.Tensor:
        if split is None or self.tp_mode == "blockwise":
            rows, cols = update.shape   # the shard is the matrix
            result = newton_schulz(update, self.steps)
        elif self.tp_mode == "duplicated":
            rows, cols = full_shape
            shards = [torch.empty_like(update) for _ in range(group.size)]
            dist.all_gather(shards, update.contiguous(), group=group.group)
            result = newton_schulz(torch.cat(shards, dim=split), self.steps).chunk(group.size, dim=split)[group.rank]
        else:
            rows, cols = full_shape
            result = newton_schulz(update, self.steps, split, group)
        return result.mul_(scale_factor(rows, cols, self.scale_mode) * self.extra_scale)


def owners(sizes: list[int], world: int) -> list[int]:
    """The DP rank of each matrix of these sizes: the largest first, each to the least loaded rank (the same on every
    rank; ties keep the given order). The planner counts Newton-Schulz's work per rank with it too."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(world), key=lambda r: load[r])
        load[owner[i]] += sizes[i]
    return owner


def _owners(params: list[torch.nn.Parameter], world: int) -> dict[int, int]:
    return {id(p): rank for p, rank in zip(params, owners([p.numel() for p in params], world))}


class Muon:
    """The momentum buffers of the matrix pieces and their step (see the module docstring). ``pieces``: the
    optimizer's MainPieces of Muon matrices; ``engine``: the data-parallel engine they come from."""

    def __init__(self, pieces: list, engine, settings: MuonSettings, weight_decay: float):
        self.pieces, self.settings, self.weight_decay = pieces, settings, weight_decay
        self.state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        self.engines = list(getattr(engine, "engines", [engine]))   # an EngineUnion's engines, or the one

    def momentum_buffer(self, piece) -> torch.Tensor:
        state = self.state.setdefault(piece.main, {})
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(piece.main)
        return state["momentum_buffer"]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        s = self.settings
        updates = {}
        for piece in self.pieces:
            grad = piece.grad.to(piece.main.dtype)
            buf = self.momentum_buffer(piece)
            buf.lerp_(grad, 1 - s.momentum)
            updates[id(piece.main)] = grad.lerp(buf, s.momentum) if s.nesterov else buf
        orthogonal = self._orthogonalize(updates)
        for piece in self.pieces:
            update = orthogonal[id(piece.main)].reshape(piece.main.shape)
            piece.main.mul_(1 - lr * self.weight_decay).add_(update, alpha=-lr)

    def _orthogonalize(self, updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        result = {}
        whole = [p for p in self.pieces if not self._layer_wise(p.param)]
        for piece in whole:
            param = piece.param
            result[id(piece.main)] = self.settings.orthogonalize(updates[id(piece.main)].view(param.shape), param)
        for engine in self.engines:
            if isinstance(engine, DataParallel) and engine.distributed and engine.dp > 1:
                result.update(self._layer_wise_step(engine, updates))
        # ZeRO-3: the dense matrices' mesh first, then the experts' (the same order on every rank).
        sharded = [p for e in self.engines for p in getattr(e, "params", ()) if _fully_sharded(p) and is_muon_matrix(p)]
        for experts in (False, True):
            matrices = [p for p in sharded if getattr(p, "is_expert", False) == experts]
            if matrices:
                result.update(self._fully_sharded_step(matrices, updates))
        return result

    def _layer_wise(self, param: torch.nn.Parameter) -> bool:
        return _fully_sharded(param) or any(isinstance(e, DataParallel) and e.distributed and e.dp > 1
                                            and id(param) in e.plan.ranges for e in self.engines)

    def _layer_wise_step(self, engine: DataParallel, updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The distributed optimizer's matrices, bucket by bucket: gather, orthogonalize the owned, scatter."""
        mine = [p for p in self.pieces if id(p.param) in engine.plan.ranges]
        matrices = [p for p in engine.params if is_muon_matrix(p)]
        owner = _owners(matrices, engine.dp)
        result = {}
        for bucket in engine.buckets:
            in_bucket = [p for p in bucket.params if is_muon_matrix(p)]
            if not in_bucket:
                continue
            start, end = engine.shard(bucket)
            pieces = [p for p in mine if start <= p.start < end]
            local = torch.zeros(end - start, dtype=torch.float32, device=engine.device)
            for piece in pieces:
                local[piece.start - start: piece.end - start] = updates[id(piece.main)]
            full = torch.empty(bucket.end - bucket.start, dtype=torch.float32, device=engine.device)
            _all_gather(full, local, group=engine.group.group)
            orthogonal = torch.zeros_like(full)
            for param in in_bucket:
                if owner[id(param)] == engine.dp_rank:
                    first, last = (i - bucket.start for i in engine.range(param))
                    orthogonal[first:last] = self.settings.orthogonalize(full[first:last].view(param.shape),
                                                                         param).reshape(-1)
            shard = torch.empty(end - start, dtype=torch.float32, device=engine.device)
            _reduce_scatter(shard, orthogonal, group=engine.group.group)
            for piece in pieces:
                result[id(piece.main)] = shard[piece.start - start: piece.end - start]
        return result

    def _fully_sharded_step(self, matrices: list[torch.nn.Parameter],
                            updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """ZeRO-3's matrices of one mesh (all of this rank's dense or expert matrices): each rank's rows to the
        owners, orthogonalized there, each rank's rows of the results back (two all-to-alls)."""
        mesh = matrices[0].device_mesh
        group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        device = matrices[0].to_local().device   # the compute device (Muon does not run with offloaded shards)
        owner = _owners(matrices, world)
        update_of = {id(p.param): updates[id(p.main)] for p in self.pieces if id(p.param) in owner}

        def rows(param, rank):   # the flat range of ``rank``'s rows
            first, last = row_range(param.shape[0], world, rank)
            row_size = param.numel() // param.shape[0]
            return first * row_size, last * row_size

        def size(param, rank):
            first, last = rows(param, rank)
            return last - first

        owned = [[p for p in matrices if owner[id(p)] == rank] for rank in range(world)]
        # There: this rank's rows of each owner's matrices, by owner (a rank may hold no rows of a short matrix).
        order = [p for rank in range(world) for p in owned[rank] if size(p, me)]
        send = torch.cat([update_of[id(p)] for p in order]) if order else torch.empty(0, device=device)
        to_owner = [sum(size(p, me) for p in owned[rank]) for rank in range(world)]
        from_rank = [sum(size(p, rank) for p in owned[me]) for rank in range(world)]
        received = torch.empty(sum(from_rank), dtype=torch.float32, device=device)
        dist.all_to_all_single(received, send.float(), from_rank, to_owner, group=group)
        # The owned matrices whole (each rank's rows are in matrix order within its chunk), orthogonalized.
        chunks = [list(chunk.split([size(p, rank) for p in owned[me]]))
                  for rank, chunk in enumerate(received.split(from_rank))]
        results = []
        for i, param in enumerate(owned[me]):
            whole = torch.cat([chunks[rank][i] for rank in range(world)]).view(param.shape)
            results.append(self.settings.orthogonalize(whole, param).reshape(-1))
        # Back: each rank's rows of the results.
        back = [result[slice(*rows(p, rank))] for rank in range(world) for p, result in zip(owned[me], results)]
        send = torch.cat(back) if back else torch.empty(0, device=device)
        mine = torch.empty(sum(to_owner), dtype=torch.float32, device=device)
        dist.all_to_all_single(mine, send, to_owner, from_rank, group=group)
        pieces = dict(zip(map(id, order), mine.split([size(p, me) for p in order])))
        return {id(p.main): pieces[id(p.param)] for p in self.pieces if id(p.param) in pieces}


def _fully_sharded(param: torch.nn.Parameter) -> bool:
    """A ZeRO-3 shard of a matrix split over more than one rank (a mesh of one holds it whole)."""
    return isinstance(param, DTensor) and param.device_mesh.size() > 1
