"""ZeRO-3 on PyTorch FSDP2: parameters, gradients and optimizer states sharded over the data-parallel ranks.

Each transformer layer, and then the rest of the model (embeddings, final norm, output layer), becomes one FSDP2
unit (``fully_shard`` over the data-parallel group of the registered layout). A unit's parameters are all-gathered
just before its forward and again before its backward, and freed after each; gradients are reduce-scattered as
backward produces them, every micro-batch, so a rank only ever keeps its 1/DP shard of parameters, gradients and
Adam states, plus one or two whole layers in flight. This is DeepSpeed's ZeRO-3 in its communication too: an
all-gather in forward, another in backward and a reduce-scatter, 3x the parameters per step against 2x for
ZeRO-1/2 (Rajbhandari et al. 2020).

Composition with tensor parallelism needs nothing special: FSDP2 sees this rank's TP slice of each weight as an
ordinary tensor and shards it again, by rows (dim 0), over DP. The TP collectives inside the layers run on the
gathered slices as usual. Nor does pipelining: each model chunk is sharded on its own, and the pipeline engine's
per-micro-batch forwards and backwards trigger FSDP2's gathers and reductions through its hooks. What FSDP2 does
not know, this engine adds:

- Sums, not means: the loss is already normalized by the global token count (see megalite.training.trainer), so the
  reduction's divide factor is set to 1.
- The model-parallel sums (megalite.distributed.finalize, shared with the bucketed engine): the sequence-parallel
  parameters' gradients over TP, whose ranks hold the same row shards of them after the reduce-scatter over DP, and
  the tied word embedding's copies on the first and last pipeline stages, whose gradient shards the two stages cut
  alike (the tensors having the same shape).
- Routed experts (expert parallelism): each MoE layer's experts are a unit of their own, sharded over the
  expert-data-parallel group (DP x CP / EP, the ranks holding the same experts) instead of DP x CP.

Precision: the sharded parameters stay fp32 (they are the optimizer's main parameters, no separate copy); with bf16
or fp16 FSDP2 casts the gathered copy for compute and reduces gradients in fp32 (``MixedPrecisionPolicy``; in bf16
with ``--grad-reduce-in-bf16``).
With ``offload_params`` the parameter and gradient shards live on the CPU (``CPUOffloadPolicy``) and the optimizer
steps them there.

HSDP (``--num-distributed-optimizer-instances N``): ``data_group`` is one instance's DP x CP / N ranks and
``replica_group`` the N ranks holding the same shards in each instance; the units are sharded over a 2-D mesh
(replicate, shard), FSDP2's HSDP: parameters gathered inside the instance, gradients reduce-scattered inside it and
the shards all-reduced across the replicas.

With ``fp8_param_gather`` the FP8 linears' weights are all-gathered as FP8 bytes (megalite.distributed.
fp8_fully_sharded).

The optimizer (:class:`~megalite.optimizer.MegaliteOptimizer`) sees each parameter's local shard as one *piece*:
the flat range [start, end) of the TP slice that this DP rank owns, whose offsets are exactly those a checkpoint
stores, so stage-3 checkpoints load at stage 1 or without sharding and back.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megalite.distributed.engine import DataParallelEngine, Piece
from megalite.distributed.expert_parallel import is_expert
from megalite.distributed.finalize import finalize_model_grads
from megalite.distributed.fp8_fully_sharded import Fp8ShardScales, plain, wrap_fp8_weights
from megalite.parallel_state import GroupInfo


def _shard_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 units of one model chunk, innermost first: each transformer layer, then the chunk itself (which
    takes the parameters left over: embeddings, final norm, output layer)."""
    layers = getattr(module, "layers", None)
    return [*(layers if layers is not None else []), module]


def _expert_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost submodules holding routed experts' parameters only (an MoE layer's experts), which are units of
    their own, sharded over the expert-data-parallel group."""
    found: list[torch.nn.Module] = []
    for sub in module.modules():
        params = list(sub.parameters())
        if params and all(is_expert(p) for p in params) and not any(sub in f.modules() for f in found):
            found.append(sub)
    return found


def row_range(rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The rows [first, last) of a dim-0 shard: FSDP2's Shard(0) cuts like torch.chunk, ceil(rows / dp) each, so
    the last ranks may get fewer rows, or none."""
    per_rank = -(-rows // dp)
    first = min(dp_rank * per_rank, rows)
    return first, min(first + per_rank, rows)


class FullyShardedDataParallel(DataParallelEngine):
    """The ZeRO-3 engine."""

    distributed = True   # gradient pieces are disjoint over DP: the global norm sums over DP too

    def __init__(self, modules: list[torch.nn.Module], *, data_group: GroupInfo,
                 tensor_group: Optional[GroupInfo] = None, embedding_group: Optional[GroupInfo] = None,
                 tied_params: list[torch.nn.Parameter] = (), compute_dtype: torch.dtype = torch.float32,
                 offload_params: bool = False, prefetch_bucket_size: Optional[int] = None,
                 grad_dtype: torch.dtype = torch.float32, expert_group: Optional[GroupInfo] = None,
                 fp8_param_gather: bool = False, replica_group: Optional[GroupInfo] = None):
        """``expert_group``: the expert-data-parallel group, over which each MoE layer's experts (parameters flagged
        ``is_expert``) are sharded as a unit of their own (expert parallelism; None: a model without experts).
        ``fp8_param_gather``: the FP8 linears' weights are gathered in FP8. ``replica_group``: HSDP's replicas of
        this rank's shards (see the module docstring; not with experts or FP8 gathers)."""
        self.group, self.tensor_group, self.embedding_group = data_group, tensor_group, embedding_group
        self.device = device = next(modules[0].parameters()).device
        # Each mesh is named after its group (see _mesh).
        mesh = _mesh(data_group, replica_group, device)
        expert_mesh = (None if expert_group is None else
                       DeviceMesh.from_group(expert_group.group, device.type,
                                             mesh_dim_names=(f"expert_data_parallel_{expert_group.group.group_name}",)))
        precision = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=grad_dtype)
                     if compute_dtype != torch.float32 else MixedPrecisionPolicy())
        # Pinned host memory only helps (and only exists) with a GPU to copy to.
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload_params else OffloadPolicy()
        self.fp8_scales = Fp8ShardScales(compute_dtype, data_group) if fp8_param_gather else None
        fp8_linears = wrap_fp8_weights(modules, self.fp8_scales) if fp8_param_gather else []
        for m in modules:   # an FP8 copy of each whole weight kept for the step would undo the sharding
            for sub in m.modules():
                if getattr(sub, "fp8", None) is not None:
                    sub.fp8_weight_cache = False
        places = {(id(owner), name): (owner, param) for m in modules for owner in m.modules()
                  for name, param in owner.named_parameters(recurse=False)}
        # What megalite marks on a parameter (partition, full_shape, sequence_parallel, ...) must survive FSDP2
        # replacing every parameter by a new sharded one.
        attributes = {place: dict(vars(param)) for place, (_, param) in places.items()}
        self.units: list[FSDPModule] = []
        for m in modules:
            units = [(unit, expert_mesh) for unit in _expert_modules(m)] if expert_mesh is not None else []
            for unit, unit_mesh in units + [(unit, mesh) for unit in _shard_modules(m)]:
                fully_shard(unit, mesh=unit_mesh, mp_policy=precision, offload_policy=offload)
                _reduce_by_sum(unit)
                self.units.append(unit)
            _quiet_view_warning(m)
            if prefetch_bucket_size is not None:
                _prefetch(_shard_modules(m)[:-1], prefetch_bucket_size)
        for m in modules:
            for owner in m.modules():
                for name, param in owner.named_parameters(recurse=False):
                    for key, value in attributes.get((id(owner), name), {}).items():
                        setattr(param, key, value)
        if fp8_linears:
            self.fp8_scales.weights = [(linear, linear.weight) for linear in fp8_linears]
        tied = {id(p) for p in tied_params}
        self.tied_params = [getattr(owner, name) for (_, name), (owner, param) in places.items() if id(param) in tied]
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]
        # Persistent sharded gradients: FSDP2 adds each micro-batch's reduced shard into an existing ``.grad``, so the
        # optimizer's pieces can hold on to these tensors from step to step.
        for p in self.params:
            p.grad = torch.zeros_like(p)

    # ---- pieces (what this rank owns of each parameter) ------------------------------------------------------------
    def range(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """The parameter's flat range in its own coordinates (the TP slice, flattened): [0, numel)."""
        return 0, param.numel()

    def pieces(self) -> list[Piece]:
        """This rank's row shard of every parameter that has one (a short parameter may leave a rank nothing)."""
        result = []
        for p in self.params:
            rows = p.shape[0]
            # The shard dimension, the last: DP x CP (or one HSDP instance of it), or expert-data-parallel
            mesh, shard_dim = p.device_mesh, p.device_mesh.ndim - 1
            dp, dp_rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
            first, last = row_range(rows, dp, dp_rank)
            if first == last:
                continue
            row_size = p.numel() // rows
            local = plain(p.to_local())   # an FP8 weight's shard: the fp32 tensor inside, same storage
            if local.numel() != (last - first) * row_size:
                raise RuntimeError(f"FSDP2 sharded a {list(p.shape)} parameter into {list(local.shape)} on DP rank "
                                   f"{dp_rank}; expected rows [{first}, {last})")
            result.append(Piece(p, first * row_size, last * row_size, local.view(-1), p.grad.to_local().view(-1)))
        return result

    def held_bytes(self) -> tuple[int, int]:
        return (sum(p.to_local().numel() * p.element_size() for p in self.params),
                sum(p.grad.to_local().numel() * p.grad.element_size() for p in self.params))

    # ---- iteration --------------------------------------------------------------------------------------------------
    def start_iteration(self, num_micro_batches: int) -> None:
        """Nothing to count: FSDP2 reduce-scatters each micro-batch's gradients during its backward."""

    def finish_grad_sync(self) -> None:
        finalize_model_grads(self)   # the tied copies summed, reduce_data_parallel, the sequence-parallel sums

    def tied_gradients(self) -> list[torch.Tensor]:
        """The tied copies' gradient shards (already reduced over DP)."""
        return [p.grad.to_local().view(-1) for p in self.tied_params]

    def reduce_data_parallel(self) -> None:
        """Nothing left: FSDP2's reduce-scatters completed within each micro-batch's backward."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad.to_local().zero_()

    def gather_params(self) -> None:
        """Nothing to gather after the step: each unit gathers its updated shards when its next forward starts (the
        FP8 weights with scales of the updated weights)."""
        if self.fp8_scales is not None:
            self.fp8_scales.invalidate()

    def finish_param_sync(self) -> None:
        """Put every unit back in its sharded state. FSDP2 keeps the root unit gathered after a forward without
        backward (evaluation), with its gathered, unmarked parameters registered on the modules; checkpoints,
        evaluation and callers after training must see the shards."""
        for unit in self.units:
            unit.reshard()


def _mesh(data_group: GroupInfo, replica_group: Optional[GroupInfo], device: torch.device) -> DeviceMesh:
    """The ranks FSDP2 shards over: ``data_group``, or with HSDP replicas the 2-D (replicate, shard) mesh."""
    # Meshes over the same ranks compare equal unless their names differ, and DTensor caches communication plans
    # by mesh: naming the mesh after its group keeps a later layout (tests build many) off a destroyed group.
    name = f"data_parallel_{data_group.group.group_name}"
    if replica_group is None or replica_group.size == 1:
        return DeviceMesh.from_group(data_group.group, device.type, mesh_dim_names=(name,))
    # Row i is instance i. The DP x CP ranks are evenly spaced (TP apart), so instance i's members are this
    # instance's shifted by the distance from this rank to its replica in instance i.
    me = data_group.ranks[data_group.rank]
    rows = [[member + replica - me for member in data_group.ranks] for replica in replica_group.ranks]
    return DeviceMesh.from_group([replica_group.group, data_group.group], device.type, mesh=rows,
                                 mesh_dim_names=(f"replicas_{replica_group.group.group_name}", name))


def _quiet_view_warning(chunk: torch.nn.Module) -> None:
    """FSDP2 warns at every forward that a unit returning a view (our hidden states and per-token losses are views)
    would lose its pre-backward hook if the caller modified the view in place, which the trainer and the pipeline
    engine never do. Ignore that warning within each forward of the chunk (its layers run inside it): a hook before
    FSDP2's opens a ``catch_warnings`` scope, one after FSDP2's (even when the forward raises) closes it."""
    scopes = []

    def enter(module, args):
        scopes.append(warnings.catch_warnings())
        scopes[-1].__enter__()
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    chunk.register_forward_pre_hook(enter, prepend=True)
    chunk.register_forward_hook(lambda *_: scopes.pop().__exit__(None, None, None), always_call=True)


def _prefetch(layers: list[FSDPModule], bucket_size: int) -> None:
    """Explicit prefetching (DeepSpeed's stage3_prefetch_bucket_size): when a layer's parameters have been gathered,
    FSDP2 starts gathering those of the next layers (in backward, the previous ones) whose gathered elements add up
    to at most ``bucket_size``, and always the next one. FSDP2's default is the next one only, which it issues when
    the next layer starts; more layers ahead overlap more communication with compute, at the cost of their memory.
    The values gathered are the same, so the results are too."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]   # DTensor numel: the unsharded size

    def within_budget(order: list[int]) -> list[FSDPModule]:
        chosen, total = [], 0
        for i in order:
            total += sizes[i]
            if chosen and total > bucket_size:
                break
            chosen.append(layers[i])
        return chosen

    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(within_budget(list(range(i + 1, len(layers)))))
        layer.set_modules_to_backward_prefetch(within_budget(list(range(i - 1, -1, -1))))


def _reduce_by_sum(unit: FSDPModule) -> None:
    """Reduce-scatter gradients as a plain sum. A divide factor of 1 alone makes FSDP2 use a pre-multiplied sum,
    which gloo lacks; forcing SUM reductions with factor 1 leaves no division at all."""
    setter = getattr(unit, "set_gradient_divide_factor", None) or unit.set_reduce_scatter_divide_factor
    setter(1.0)
    if hasattr(unit, "set_force_sum_reduction_for_comms"):   # older torch: NCCL's pre-multiplied sum does it
        unit.set_force_sum_reduction_for_comms(True)


def full_local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This TP rank's whole slice of ``param``: all-gathered over DP if it is a ZeRO-3 shard (collective over the
    data-parallel group, so every DP rank must call it for the same parameters in the same order)."""
    if isinstance(param, DTensor):
        local, mesh = param.to_local(), param.device_mesh
        if local.device.type != mesh.device_type:   # a CPU-offloaded shard: gathered on the mesh's device (NCCL's)
            param = DTensor.from_local(local.to(mesh.device_type), mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
        return param.full_tensor().detach()
    return param.detach()


@torch.no_grad()
def copy_into_parameter(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param`` to ``value`` (this TP rank's whole slice); a ZeRO-3 shard takes only its own rows."""
    if isinstance(param, DTensor):
        local = param.to_local()
        if local.numel() == 0:
            return
        dp_group = param.device_mesh.get_group()
        first, last = row_range(value.shape[0], dist.get_world_size(dp_group), dist.get_rank(dp_group))
        local.copy_(value[first:last])
        return
    param.copy_(value)
