"""Process groups for a (TP, CP, DP, PP) layout with expert parallelism: the one piece of global state megalite keeps.

Rank order (Megatron's default): tensor-parallel ranks are adjacent, then context-parallel, then data-parallel, then
pipeline-parallel::

    rank = pp_rank * (DP * CP * TP) + dp_rank * (CP * TP) + cp_rank * TP + tp_rank

so a TP group sits inside one node (fast links), a CP ring next to it, and pipeline stages are the farthest apart.
For TP=2, PP=2, DP=2 (8 ranks): TP groups [0,1] [2,3] [4,5] [6,7]; DP groups [0,2] [1,3] [4,6] [5,7]; PP groups
[0,4] [1,5] [2,6] [3,7]; model-parallel groups (TP x PP) [0,1,4,5] [2,3,6,7]; embedding groups (first and last
stage) = the PP groups' ends. With CP=2, TP=2 (4 ranks): CP groups [0,2] [1,3].

Every group kind is the set of ranks that differ only in some of the four coordinates (``GROUP_DIMENSIONS``; one
builder, :func:`layout_groups`, makes them all). Context-parallel ranks hold the same weights and different tokens of
the same samples, so everything that treats model replicas (gradient reduction, the distributed optimizer, ZeRO-3,
the gradient norm's shards) runs over ``data_context`` = DP x CP, while the data sampler uses ``data`` (pure DP: the
CP ranks of one DP rank read the same samples). A new kind (e.g. expert parallelism carved from DP x CP) is one more
entry of the table and one more field of :class:`ParallelState`.

Expert parallelism (EP, Megatron-core's way) carves the same ranks differently: the DP x CP ranks of one (TP rank,
stage) are re-split as EP innermost times the expert-data-parallel size EDP = DP x CP / EP, so that
``rank = pp_rank * (EDP * EP * TP) + edp_rank * (EP * TP) + ep_rank * TP + tp_rank`` (``EXPERT_DIMENSIONS``). The
``expert`` group (EP ranks, which hold different experts and exchange tokens) and the ``expert_data`` group (the
replicas of one set of experts, over which expert gradients are summed) come from the same builder. For DP=4, EP=2
(4 ranks): expert groups [0,1] [2,3], expert-data groups [0,2] [1,3]. ``expert_tensor`` is the tensor group when
the experts are split over TP (``--expert-tensor-parallel-size`` = TP, the default) and each rank alone when they are
not (size 1: every TP rank holds whole experts).

HSDP (``--num-distributed-optimizer-instances N``, Megatron's distributed-optimizer instances) cuts each DP x CP
group into N instances of adjacent members (``intra_instance``: the ranks the distributed optimizer or ZeRO-3 shards
over, inside a node when DP x CP / N ranks fit there) and joins the members at the same place of each instance
(``inter_instance``: the replicas of one shard, over which the reduced shards are all-reduced). For DP=4, N=2:
instances [0,1] [2,3], replicas [0,2] [1,3]. With N=1 the instance is the DP x CP group and each rank its own replica.

A layout may cover a subset of the world (``ranks=``): the tests use it to run a 2-rank layout inside a 4-rank launch,
and a 1x1x1 layout on every rank as the single-process reference. Groups of one member are never created: the
communication helpers treat a size-1 group as "nothing to do", which is also what makes the reference run cheap.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megalite.config.dims import ParallelDims


@dataclass(frozen=True)
class GroupInfo:
    """A process group as seen by one rank: its torch group (None when size 1), members, and our place in it."""
    group: Optional[dist.ProcessGroup]
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank() if dist.is_initialized() else 0)

    def start_sum(self, value: torch.Tensor) -> Optional[dist.Work]:
        """Launch the in-place sum of ``value`` over the members; its Work (None alone: nothing to wait for)."""
        return dist.all_reduce(value, group=self.group, async_op=True) if self.size > 1 else None

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed in place over the members (alone: as it is)."""
        return self._reduce(value, dist.ReduceOp.SUM)

    def max(self, value: torch.Tensor) -> torch.Tensor:
        return self._reduce(value, dist.ReduceOp.MAX)

    def min(self, value: torch.Tensor) -> torch.Tensor:
        return self._reduce(value, dist.ReduceOp.MIN)

    def _reduce(self, value: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(value, op=op, group=self.group)
        return value


@dataclass(frozen=True)
class ParallelState:
    tensor: GroupInfo
    context: GroupInfo
    data: GroupInfo
    data_context: GroupInfo   # DP x CP: the ranks holding the same model shard (gradients are summed over it)
    pipeline: GroupInfo
    model: GroupInfo       # TP x PP: everything that holds one replica of the model
    expert: GroupInfo      # EP: the ranks holding different experts of the same layers (tokens travel between them)
    expert_data: GroupInfo   # DP x CP / EP: the ranks holding the same experts (expert gradients are summed over it)
    expert_tensor: GroupInfo   # the TP group if experts are split over TP, else this rank alone
    embedding: Optional[GroupInfo]   # first and last pipeline stage (tied word embeddings); None elsewhere
    intra_instance: GroupInfo   # HSDP: this rank's distributed-optimizer instance, DP x CP / N adjacent ranks
    inter_instance: GroupInfo   # HSDP: the N ranks holding the same shard in each instance
    # size -> the group of that many consecutive ranks of this rank's TP group, for every size that divides TP
    # (1 < size < TP): the ranks sharing one key/value head when there are fewer key/value heads than TP ranks.
    tensor_shares: dict[int, GroupInfo] = field(default_factory=dict, hash=False)
    # size a -> (the a consecutive ranks of this rank's CP group, the CP / a ranks a apart), for every 1 < a < CP
    # dividing CP: hierarchical context parallelism's two levels (a2a inside, the p2p ring across).
    context_shares: dict[int, tuple[GroupInfo, GroupInfo]] = field(default_factory=dict, hash=False)


_STATE: Optional[ParallelState] = None

# The coordinates of a rank, innermost first (the rank order above), and which of them each group kind spans: a
# group is the ranks that agree on every other coordinate. Its members are listed in rank order.
DIMENSIONS = ("tp", "cp", "dp", "pp")
GROUP_DIMENSIONS = {
    "tensor": ("tp",),
    "context": ("cp",),
    "data": ("dp",),
    "data_context": ("cp", "dp"),
    "pipeline": ("pp",),
    "model": ("tp", "pp"),
}
# The same ranks in expert coordinates: DP x CP (CP innermost) re-split as EP innermost, then EDP.
EXPERT_DIMENSIONS = ("tp", "ep", "edp", "pp")
EXPERT_GROUP_DIMENSIONS = {
    "expert": ("ep",),
    "expert_data": ("edp",),
}


def rank_of(sizes: dict[str, int], coordinates: dict[str, int], dimensions: tuple[str, ...] = DIMENSIONS) -> int:
    """The layout-local rank at ``coordinates`` (innermost first: TP, then CP, DP, PP; or TP, EP, EDP, PP)."""
    rank, stride = 0, 1
    for dim in dimensions:
        rank += coordinates[dim] * stride
        stride *= sizes[dim]
    return rank


def _groups_spanning(sizes: dict[str, int], dimensions: tuple[str, ...],
                     spanned: tuple[str, ...]) -> list[list[int]]:
    """The groups of ranks that agree on every coordinate but ``spanned``, in rank order."""
    fixed = [d for d in reversed(dimensions) if d not in spanned]   # outermost first: groups in rank order
    inner = [d for d in reversed(dimensions) if d in spanned]
    groups = []
    for outside in itertools.product(*(range(sizes[d]) for d in fixed)):
        members = [rank_of(sizes, {**dict(zip(fixed, outside)), **dict(zip(inner, inside))}, dimensions)
                   for inside in itertools.product(*(range(sizes[d]) for d in inner))]
        groups.append(sorted(members))
    return groups


def layout_groups(num_ranks: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                  etp: Optional[int] = None, instances: int = 1) -> dict[str, list[list[int]]]:
    """All groups of the layout as lists of layout-local ranks (pure function, tested on its own). ``ep`` must
    divide DP x CP; ``etp`` (default TP) is TP or 1; ``instances`` (HSDP) divides DP x CP. The sizes are
    :class:`ParallelDims`' (ConfigError, a ValueError, if the ranks are not whole TP x CP x PP replicas)."""
    dims = ParallelDims(num_ranks, tp, cp, pp, ep, etp, instances)
    dims.check()
    if dims.dp_cp % ep:
        raise ValueError(f"EP {ep} does not divide DP x CP = {dims.dp_cp}")
    if etp not in (None, tp, 1):
        raise ValueError(f"expert tensor-parallel size {etp} must be TP ({tp}) or 1")
    sizes = {"tp": tp, "cp": cp, "dp": dims.dp, "pp": pp}
    groups = {kind: _groups_spanning(sizes, DIMENSIONS, spanned) for kind, spanned in GROUP_DIMENSIONS.items()}
    expert_sizes = {"tp": tp, "ep": ep, "edp": dims.expert_dp, "pp": pp}
    groups.update({kind: _groups_spanning(expert_sizes, EXPERT_DIMENSIONS, spanned)
                   for kind, spanned in EXPERT_GROUP_DIMENSIONS.items()})
    groups["expert_tensor"] = groups["tensor"] if dims.expert_tp == tp else [[r] for r in range(num_ranks)]
    size = dims.shard_dp
    groups["intra_instance"] = [members[i:i + size] for members in groups["data_context"]
                                for i in range(0, len(members), size)]
    groups["inter_instance"] = [members[j::size] for members in groups["data_context"] for j in range(size)]
    # The tied word embedding lives on the first and last stage of each pipeline.
    groups["embedding"] = [sorted({members[0], members[-1]}) for members in groups["pipeline"]]
    return groups


def tensor_share_groups(num_ranks: int, tp: int, pp: int, cp: int = 1) -> dict[int, list[list[int]]]:
    """size -> every TP group cut into groups of ``size`` consecutive ranks, for each size 1 < size < TP dividing
    TP (pure function): the TP / G ranks that share a key/value head under grouped-query attention with G < TP."""
    tensor = layout_groups(num_ranks, tp, pp, cp)["tensor"]
    return {size: [members[i:i + size] for members in tensor for i in range(0, tp, size)]
            for size in range(2, tp) if tp % size == 0}


def context_share_groups(num_ranks: int, tp: int, pp: int, cp: int) -> dict[int, list[list[list[int]]]]:
    """size a -> [inner groups, outer groups]: every CP group cut into groups of ``a`` consecutive ranks, and into
    groups of the ranks ``a`` apart, for each 1 < a < CP dividing CP (pure function): the a2a and p2p levels of
    --cp-comm-type a2a+p2p."""
    context = layout_groups(num_ranks, tp, pp, cp)["context"]
    return {a: [[members[i:i + a] for members in context for i in range(0, cp, a)],
                [members[j::a] for members in context for j in range(a)]]
            for a in range(2, cp) if cp % a == 0}


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              ranks: Optional[Sequence[int]] = None,
                              timeout: Optional[datetime.timedelta] = None,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: Optional[int] = None,
                              num_distributed_optimizer_instances: int = 1) -> ParallelState:
    """Build every group of the layout over ``ranks`` (default: the whole world) and register them.

    Every process of the world must call this with the same arguments (torch's ``new_group`` is collective), except
    when all groups have size 1 (a 1x1x1 layout), which creates nothing and may differ per rank. ``timeout`` bounds
    every collective on the new groups; by default it is the world group's own (torch's ``new_group`` would not
    inherit it and falls back to 30 minutes, so a dead rank would strand its peers that long).
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if dist.is_initialized() else 0
    ranks = list(range(world)) if ranks is None else list(ranks)
    if timeout is None and dist.is_initialized():
        timeout = world_timeout()
    groups = layout_groups(len(ranks), tensor_model_parallel_size, pipeline_model_parallel_size,
                           context_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size,
                           num_distributed_optimizer_instances)
    mine: dict[str, GroupInfo] = {}
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}   # one torch group per member list (kinds may coincide)
    for kind, members_list in groups.items():
        for members in members_list:
            global_members = tuple(ranks[r] for r in members)
            # new_group is collective over the world: every rank creates every group, in the same order.
            if len(global_members) > 1 and global_members not in made:
                # named, so that NCCL's watchdog and megalite.training.failures say which group a collective was on
                made[global_members] = dist.new_group(list(global_members), timeout=timeout, group_desc=kind)
            if me in global_members:
                mine[kind] = GroupInfo(made.get(global_members), global_members)
    shares: dict[int, GroupInfo] = {}
    for size, members_list in tensor_share_groups(len(ranks), tensor_model_parallel_size,
                                                  pipeline_model_parallel_size, context_parallel_size).items():
        for members in members_list:   # every rank creates every one, in this same order
            global_members = tuple(ranks[r] for r in members)
            group = dist.new_group(list(global_members), timeout=timeout, group_desc=f"tensor_share{size}")
            if me in global_members:
                shares[size] = GroupInfo(group, global_members)
    context_shares: dict[int, list[GroupInfo]] = {}
    for size, levels in context_share_groups(len(ranks), tensor_model_parallel_size, pipeline_model_parallel_size,
                                             context_parallel_size).items():
        for level, members_list in zip(("context_inner", "context_outer"), levels):
            for members in members_list:   # every rank creates every one, in this same order
                global_members = tuple(ranks[r] for r in members)
                group = dist.new_group(list(global_members), timeout=timeout, group_desc=f"{level}{size}")
                if me in global_members:
                    context_shares.setdefault(size, []).append(GroupInfo(group, global_members))
    if me not in ranks:
        return None
    _STATE = ParallelState(**{"embedding": None, **mine}, tensor_shares=shares,
                           context_shares={size: tuple(levels) for size, levels in context_shares.items()})
    return _STATE


def world_timeout() -> Optional[datetime.timedelta]:
    """The collective timeout the world group was created with (None where this torch does not expose it)."""
    world = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend(world) == "nccl" else "cpu")
    try:
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class _SimulatedGroupInfo(GroupInfo):
    """A group of a shape-only layout: no torch group, and this "rank"'s place in it given, not read from torch."""
    position: int = 0

    @property
    def rank(self) -> int:
        return self.position


@contextlib.contextmanager
def simulated_layout(tp: int = 1, pp: int = 1, dp: int = 1, *, cp: int = 1, tp_rank: int = 0, pp_rank: int = 0,
                     dp_rank: int = 0, cp_rank: int = 0, ep: int = 1,
                     etp: Optional[int] = None) -> Iterator[ParallelState]:
    """Register a TP x CP x DP x PP layout (with EP carved from DP x CP) *for shapes only*, as seen by one rank of
    it, inside the block.

    Every group has ``group=None`` and the sizes and ranks of the layout, so modules build exactly the tensors that
    rank would hold (e.g. ``with simulated_layout(4, 2, pp_rank=1), torch.device("meta"): GPTModel(...)`` counts
    the parameters of stage 1 at TP=4 without processes or memory). For planning and counting only: never run a
    collective under it (there is no group to run it on). The previously registered layout, if any, comes back
    afterwards."""
    global _STATE
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    coordinates = {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}
    if not all(0 <= coordinates[d] < sizes[d] for d in DIMENSIONS):
        raise ValueError(f"ranks ({tp_rank}, {pp_rank}, {dp_rank}, {cp_rank}) outside the layout TP {tp} x PP {pp} "
                         f"x DP {dp} x CP {cp}")
    me = rank_of(sizes, coordinates)
    mine = {kind: _SimulatedGroupInfo(None, tuple(m), m.index(me))
            for kind, members in layout_groups(tp * cp * dp * pp, tp, pp, cp, ep, etp).items() for m in members
            if me in m}
    shares = {size: _SimulatedGroupInfo(None, tuple(m), m.index(me))
              for size, members in tensor_share_groups(tp * cp * dp * pp, tp, pp, cp).items()
              for m in members if me in m}
    context_shares = {size: tuple(_SimulatedGroupInfo(None, tuple(m), m.index(me)) for members in levels
                                  for m in members if me in m)
                      for size, levels in context_share_groups(tp * cp * dp * pp, tp, pp, cp).items()}
    # A middle stage has no embedding group.
    previous, _STATE = _STATE, ParallelState(**{"embedding": None, **mine}, tensor_shares=shares,
                                             context_shares=context_shares)
    try:
        yield _STATE
    finally:
        _STATE = previous


def destroy_model_parallel() -> None:
    """Forget the registered groups (and destroy the torch groups) so a new layout can be built."""
    global _STATE
    if _STATE is not None and dist.is_initialized():
        seen = set()
        infos = [info for kind, info in vars(_STATE).items() if kind not in ("tensor_shares", "context_shares")]
        shared = [info for levels in _STATE.context_shares.values() for info in levels]
        for info in infos + list(_STATE.tensor_shares.values()) + shared:
            if info is not None and info.group is not None and id(info.group) not in seen:
                seen.add(id(info.group))
                dist.destroy_process_group(info.group)
    _STATE = None


def is_initialized() -> bool:
    return _STATE is not None


def layout_size() -> int:
    """Ranks in the registered layout: TP x CP x DP x PP (the world, unless it was built over fewer ranks)."""
    s = state()
    return s.tensor.size * s.context.size * s.data.size * s.pipeline.size


def state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialized; call initialize_model_parallel()")
    return _STATE


def get_tensor_model_parallel_group() -> GroupInfo:
    return state().tensor


def get_tensor_model_parallel_rank() -> int:
    return state().tensor.rank


def get_tensor_model_parallel_world_size() -> int:
    return state().tensor.size


def get_tensor_model_parallel_subgroup(size: int) -> GroupInfo:
    """The ``size`` consecutive ranks of this rank's TP group that include it (``size`` > 1 divides TP): the whole TP
    group or one of :func:`tensor_share_groups`."""
    tensor = state().tensor
    if size == tensor.size:
        return tensor
    if size not in state().tensor_shares:
        raise ValueError(f"a group of {size} tensor-parallel ranks does not divide TP {tensor.size}")
    return state().tensor_shares[size]


def get_pipeline_model_parallel_group() -> GroupInfo:
    return state().pipeline


def get_pipeline_model_parallel_rank() -> int:
    return state().pipeline.rank


def get_pipeline_model_parallel_world_size() -> int:
    return state().pipeline.size


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_context_parallel_group() -> GroupInfo:
    return state().context


def get_hierarchical_context_parallel_groups(a2a_size: int) -> tuple[GroupInfo, GroupInfo]:
    """(the ``a2a_size`` consecutive ranks of this rank's CP group, the CP / a2a_size ranks that many apart):
    --cp-comm-type a2a+p2p's all-to-all group and ring."""
    if a2a_size not in state().context_shares:
        raise ValueError(f"no hierarchical context-parallel groups of {a2a_size} in CP {state().context.size}")
    return state().context_shares[a2a_size]


def get_context_parallel_rank() -> int:
    return state().context.rank


def get_context_parallel_world_size() -> int:
    return state().context.size


def get_data_parallel_group(with_context_parallel: bool = False) -> GroupInfo:
    """The data-parallel group; ``with_context_parallel``: DP x CP, every rank holding this rank's model shard."""
    return state().data_context if with_context_parallel else state().data


def get_intra_distributed_optimizer_instance_group() -> GroupInfo:
    """HSDP: the DP x CP / N adjacent ranks this rank's optimizer states (gradients, parameters per ZeRO stage) are
    sharded over; the whole DP x CP group when N = 1."""
    return state().intra_instance


def get_inter_distributed_optimizer_instance_group() -> GroupInfo:
    """HSDP: the N ranks, one per instance, holding the same shard (this rank alone when N = 1)."""
    return state().inter_instance


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return get_data_parallel_group(with_context_parallel).rank


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return get_data_parallel_group(with_context_parallel).size


def get_model_parallel_group() -> GroupInfo:
    return state().model


def get_expert_model_parallel_group() -> GroupInfo:
    return state().expert


def get_expert_model_parallel_rank() -> int:
    return state().expert.rank


def get_expert_model_parallel_world_size() -> int:
    return state().expert.size


def get_expert_data_parallel_group() -> GroupInfo:
    return state().expert_data


def get_expert_tensor_parallel_group() -> GroupInfo:
    return state().expert_tensor


def get_expert_tensor_parallel_world_size() -> int:
    return state().expert_tensor.size


def get_embedding_group() -> Optional[GroupInfo]:
    """The group of first and last pipeline stage holding this rank, or None on a middle stage."""
    return state().embedding


def collective_device() -> torch.device:
    """The device of the tensors the world's groups carry, for a sum whose inputs may sit elsewhere (CPU-offloaded
    shards) or be missing: this rank's GPU under NCCL (an NCCL group serves CUDA tensors only), the CPU under gloo
    or without a world. torch's rule for object collectives: the CPU if the group serves it, else its one device."""
    if not dist.is_initialized():
        return torch.device("cpu")
    kind = dist.distributed_c10d._get_object_coll_device()
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank of the layout if ``flag`` is True on any: a MAX over the model-parallel group (one model
    replica), then over DP x CP (the replicas), which together connect every rank of the layout."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)   # a count-like flag: 0 unless raised
    for info in (get_model_parallel_group(), get_data_parallel_group(with_context_parallel=True)):
        info.max(value)
    return bool(value.item())


def first_message(message: Optional[str], device: torch.device) -> Optional[str]:
    """The first non-None ``message`` over the ranks of the layout, the same on every rank (None if there is none):
    how one rank's error reaches every rank so that each reports the same line. Strings travel only when
    :func:`any_rank` says there is one, over the same two groups."""
    if not any_rank(message is not None, device):
        return None
    for info in (get_model_parallel_group(), get_data_parallel_group(with_context_parallel=True)):
        if info.size > 1:
            gathered: list[Optional[str]] = [None] * info.size
            dist.all_gather_object(gathered, message, group=info.group)
            message = next((m for m in gathered if m is not None), None)
    return message
