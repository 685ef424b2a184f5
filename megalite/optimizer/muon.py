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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import OptimizerConfig
from megalite.distributed.data_parallel import DataParallel
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


def _owners(params: list[torch.nn.Parameter], world: int) -> dict[int, int]:
    """Each matrix's DP rank: the largest first, each to the least loaded rank (the same on every rank)."""
    load = [0] * world
    owner = {}
    for param in sorted(params, key=lambda p: -p.numel()):
        rank = min(range(world), key=lambda r: load[r])
        owner[id(param)] = rank
        load[rank] += param.numel()
    return owner


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
        return result

    def _layer_wise(self, param: torch.nn.Parameter) -> bool:
        return any(isinstance(e, DataParallel) and e.distributed and e.dp > 1 and id(param) in e.plan.ranges
                   for e in self.engines)

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

