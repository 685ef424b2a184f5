"""The out-of-memory doctor: when training runs out of memory, say which part of the memory is too big and what to
change, with the planner's numbers for the failing rank's pipeline stage.

Three verdicts: the model states alone (weights, gradients, optimizer states, and at ZeRO-3 the layers gathered for
compute) leave no room, so they must be split or sharded (tensor/pipeline parallelism, the distributed optimizer,
ZeRO-3 when there is no pipeline, CPU offload); or the states fit and the
activations do not (smaller micro-batch with more accumulation, recompute, sequence parallelism); or the estimate
fits and the error comes from what it leaves out (fragmentation, transient buffers). Each comes with the planner's
suggested layout for the same GPUs. The device size is read from the CUDA error message ("GPU 0 has a total
capacity of 79.11 GiB"), else from the device, else (CPU) the host's memory shared by its ranks.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

import torch

from megalite import parallel_state
from megalite.config import MegaliteConfig
from megalite.config.flags import FLAG
from megalite.planner.dry_run import dtype_bytes, numerics_for
from megalite.planner.hardware import GiB, Hardware, gib
from megalite.planner.layout import Layout
from megalite.planner.memory import StageMemory, stage_memory
from megalite.planner.search import search

_CAPACITY = re.compile(r"total capacity of ([0-9.]+) (GiB|MiB|KiB)")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
USABLE = 0.9   # as the planner's default headroom


# How allocators say it: CUDA's and older torch's "out of memory", the CPU allocator's "can't allocate memory" (Linux:
# "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate
# memory)") and "not enough memory" (Windows).
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError, Python's MemoryError, or a RuntimeError in an allocator's words."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and any(words in str(error).lower() for words in _OUT_OF_MEMORY))


def device_memory_bytes(error: BaseException) -> float:
    """The device's size: from the CUDA message, the device, or this host's memory over its local ranks."""
    match = _CAPACITY.search(str(error))
    if match:
        return float(match.group(1)) * _UNITS[match.group(2)]
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local


def _pp_rank(layout: Layout) -> int:
    if parallel_state.is_initialized():
        return parallel_state.get_pipeline_model_parallel_rank()
    return int(os.environ.get("RANK", "0")) // (layout.tp * layout.cp * layout.dp)   # rank order: TP, CP, DP, PP


def diagnose_out_of_memory(cfg: MegaliteConfig, error: BaseException, *, world_size: Optional[int] = None,
                           device_memory: Optional[float] = None, cuda: Optional[bool] = None,
                           suggest: bool = True) -> str:
    """A few lines: which memory is too big on this rank, by how much, what to change, the planner's layout."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() if cuda is None else cuda
    device = device_memory or device_memory_bytes(error)
    layout = Layout.from_config(cfg, world_size)
    pp_rank = _pp_rank(layout)
    model = cfg.model   # a resolved run's: its vocabulary is the tokenizer's (megalite.run)
    gbs, nbytes, numerics = cfg.training.global_batch_size, dtype_bytes(cfg), numerics_for(cfg, cuda)

    def memory(lay: Layout, m=model) -> StageMemory:
        return stage_memory(m, lay, pp_rank, gbs, dtype_bytes=nbytes, numerics=numerics,
                            bucket_size=cfg.optimizer.ddp_bucket_size,
                            prefetch_bucket_size=cfg.optimizer.zero3_prefetch_bucket_size)

    mem = memory(layout)
    usable = USABLE * device
    where = (f"rank {os.environ.get('RANK', '0')} (pipeline stage {pp_rank} of {layout.pp}, "
             f"{layout.describe()}) on a {gib(device)} device")
    split = (f"weights {gib(mem.weights)} + gradients {gib(mem.gradients)} + optimizer {gib(mem.optimizer)}"
             + (f" + gathered layers {gib(mem.gathered)}" if mem.gathered else "") + f" = {gib(mem.fixed)}")
    if mem.fixed > usable:
        lines = [f"megalite: out of memory on {where}: the model states alone exceed the device: {split}, before "
                 f"{gib(mem.activations)} of activations."]
        lines.append("  Split or shard them: " + ", ".join(_sharding_options(layout, memory, model.num_experts)) + ".")
    elif mem.total > usable:
        lines = [f"megalite: out of memory on {where}: the activations do not fit: {gib(mem.activations)} of "
                 f"activations on top of {gib(mem.fixed)} of model states ({split})."]
        options = []
        b = layout.micro_batch_size
        if b > 1:
            smaller = dataclasses.replace(layout, micro_batch_size=b // 2)
            options.append(f"{FLAG.micro_batch_size} {b // 2} (more accumulation, same global batch: "
                           f"{gib(memory(smaller).activations)})")
        for granularity in ("selective", "full"):
            if layout.recompute != "full" and layout.recompute != granularity:
                lay = dataclasses.replace(layout, recompute=granularity)
                flag = "selective" if granularity == "selective" else f"full {FLAG.recompute_method} uniform"
                after = memory(lay, lay.model_config(model)).activations
                if after < 0.9 * mem.activations:   # selective saves nothing s^2-sized under flash attention
                    options.append(f"{FLAG.recompute_granularity} {flag} ({gib(after)})")
        if layout.tp > 1 and not layout.sequence_parallel:
            options.append(f"{FLAG.sequence_parallel} "
                           f"({gib(memory(dataclasses.replace(layout, sequence_parallel=True)).activations)})")
        lines.append("  Shrink them: " + (", ".join(options) if options else "more tensor/pipeline parallelism")
                     + ".")
    else:
        lines = [f"megalite: out of memory on {where}, although the estimate fits: {split} + "
                 f"{gib(mem.activations)} of activations = {gib(mem.total)} of {gib(device)}.",
                 "  What the estimate leaves out ran over: fragmentation (try PYTORCH_CUDA_ALLOC_CONF="
                 "expandable_segments:True), transient buffers, other processes on the device; or use a smaller "
                 "micro-batch."]
    if suggest:
        lines.append("  " + _suggestion(cfg, model, layout, world_size, device, nbytes, numerics))
    return "\n".join(lines)


def _sharding_options(layout: Layout, memory, experts: Optional[int] = None) -> list[str]:
    """What shrinks the model states of ``layout``, each with the device bytes it leaves (``memory(layout)``); an
    option that would not shrink them (ZeRO-3's gathered layers can outweigh what it shards, in a small model or at
    a small DP) is left out. A mixture of ``experts`` may spread them over more expert-parallel ranks."""
    now = memory(layout).fixed
    options = ["more tensor or pipeline parallelism (the states shrink with TP x PP)"]

    def offer(flags: str, what: str, **changes) -> None:
        after = memory(dataclasses.replace(layout, **changes)).fixed
        if after < now:
            options.append(f"{flags} ({gib(after)}{what})")

    if layout.zero == 0 and layout.replicas > 1:
        offer(FLAG.use_distributed_optimizer, " of states", zero=1)
    elif layout.zero == 1:
        offer(f"{FLAG.zero_stage} 2", "", zero=2)
    if layout.zero < 3 and layout.pp == 1 and layout.replicas > 1:   # the planner models ZeRO-3 at PP 1 only
        drop = f" without {FLAG.use_distributed_optimizer}" if layout.zero in (1, 2) else ""
        offer(f"{FLAG.zero_stage} 3{drop}", " of states and gathered layers: parameters sharded too", zero=3)
    if experts and layout.replicas % (2 * layout.ep) == 0 and experts % (2 * layout.ep) == 0:   # EP from DP x CP
        offer(f"{FLAG.expert_model_parallel_size} {2 * layout.ep}", f" of states: {experts // (2 * layout.ep)} "
              f"experts per rank", ep=2 * layout.ep)
    if not layout.optimizer_cpu_offload:
        offer(FLAG.optimizer_cpu_offload, " on the device", optimizer_cpu_offload=True)
    if layout.zero == 3 and not layout.offload_params:
        offer(f"{FLAG.optimizer_cpu_offload} {FLAG.offload_params}", " on the device: the gathered layers only",
              optimizer_cpu_offload=True, offload_params=True)
    return options


def _suggestion(cfg: MegaliteConfig, model, layout: Layout, world_size: int, device: float, nbytes: int,
                numerics) -> str:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(min(world_size, 8))))
    nodes_fill = world_size if world_size <= local else local * (world_size // local)
    hardware = Hardware(num_gpus=nodes_fill, gpus_per_node=min(local, nodes_fill), gpu_memory_gib=device / GiB)
    plan = search(model, hardware, cfg.training.global_batch_size, dtype_bytes=nbytes, numerics=numerics)
    if plan.winner is None:
        return (f"The planner finds no layout of {world_size} GPUs that fits: more GPUs, or "
                f"{FLAG.optimizer_cpu_offload} (with {FLAG.zero_stage} 3, also {FLAG.offload_params}).")
    w = plan.winner
    if w.layout == layout:
        return "The planner's best layout for these GPUs is this one: the estimate misses what ran over."
    return (f"The planner suggests {w.layout.describe()} ({gib(w.peak.total)} per GPU): "
            f"{' '.join(w.layout.argv(cfg))} (tools/plan_parallelism.py shows the whole table).")


def out_of_memory_message(cfg: MegaliteConfig, error: BaseException) -> str:
    """:func:`diagnose_out_of_memory`, or the error's first line should the diagnosis itself fail: it must never
    hide the error it explains."""
    try:
        return diagnose_out_of_memory(cfg, error)
    except Exception as failure:   # noqa: BLE001 - any failure here falls back to the plain error
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return (f"megalite: out of memory on rank {os.environ.get('RANK', '0')}: {first} (no diagnosis: "
                f"{type(failure).__name__}: {failure})")
