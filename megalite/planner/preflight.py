"""What this machine must offer the run, checked by ``pretrain_gpt.py`` on every rank before any process group: the
places the run writes into (``--save``, ``--metrics-file``, ``--tensorboard-dir``) writable, room on ``--save``'s
filesystem for one checkpoint, and room in memory for the planner's estimate (``--dry-run``'s numbers) on the GPU,
or on the host for every local rank of a CPU run. Each refusal is one ConfigError line with the numbers, so a run
that cannot save or cannot fit stops at start-up, not at its first save or when the kernel kills it.

The memory check is the dry run's estimate, but that walks every tensor of every layer (seconds at 100,000 layers):
a floor of the model states (the parameters a rank holds times the bytes each surely costs) refuses what is far too
big first, in milliseconds. The estimate can be wrong (it leaves out fragmentation and what other processes hold,
and a model unlike the ones it was tested on may surprise it): ``--skip-memory-check`` turns the memory check off.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from megalite.config import ConfigError, MegaliteConfig
from megalite.config.flags import FLAG
from megalite.pipeline.partition import chunks_of_rank
from megalite.planner.dry_run import dtype_bytes, run_memory
from megalite.planner.hardware import GiB
from megalite.planner.layout import Layout
from megalite.planner.memory import StageMemory
from megalite.planner.parameters import chunk_tensors, layer_tensors

ADAM_CHECKPOINT_BYTES = 12   # per parameter: the fp32 main copy and Adam's two moments (checkpoint/save.py)


def check_machine(cfg: MegaliteConfig, world_size: int, cuda: bool) -> None:
    """Every check of this module, cheapest first; ``cuda``: the run's device is a GPU (else the CPU)."""
    check_outputs(cfg)
    if not cfg.training.skip_memory_check:
        check_memory(cfg, world_size, cuda)
    check_disk_space(cfg)


# ---- the places the run writes into ---------------------------------------------------------------------------------

def check_outputs(cfg: MegaliteConfig) -> None:
    """--save and --tensorboard-dir are (or are made) writable directories; --metrics-file a file that can be
    appended to, in a writable directory (made if missing, like the other two)."""
    if cfg.checkpoint.save:
        _writable_directory(FLAG.save, cfg.checkpoint.save, Path(cfg.checkpoint.save))
    if cfg.logging.tensorboard_dir:
        _writable_directory(FLAG.tensorboard_dir, cfg.logging.tensorboard_dir, Path(cfg.logging.tensorboard_dir))
    if cfg.logging.metrics_file:
        path = Path(cfg.logging.metrics_file)
        if path.is_dir():
            raise ConfigError(f"{FLAG.metrics_file} {path}: a directory, not a file")
        _writable_directory(FLAG.metrics_file, cfg.logging.metrics_file, path.parent)
        try:
            with open(path, "a"):   # the run appends to it: opening it so changes nothing
                pass
        except OSError as error:
            raise ConfigError(f"{FLAG.metrics_file} {path}: cannot be written ({_reason(error)})") from None


def _writable_directory(flag: str, value: str, directory: Path) -> None:
    """Make ``directory`` (as the run would) and write a file into it: the only test that holds for root too (who
    passes every permission check but not a read-only filesystem or a regular file in the way)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        descriptor, probe = tempfile.mkstemp(prefix=".megalite-write-check-", dir=directory)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        where = "" if directory == Path(value) else f" (its directory {directory})"
        raise ConfigError(f"{flag} {value}: cannot be written{where}: {_reason(error, directory)}") from None


def _reason(error: OSError, directory: Optional[Path] = None) -> str:
    """The OS's words, or for a directory that cannot be made the regular file in its way."""
    if directory is not None and isinstance(error, (FileExistsError, NotADirectoryError)):
        blocker = next((p for p in (directory, *directory.parents) if p.exists()), directory)
        return f"{blocker} is a regular file, not a directory"
    return error.strerror or str(error)


# ---- one checkpoint on the disk -------------------------------------------------------------------------------------

def checkpoint_bytes(cfg: MegaliteConfig) -> float:
    """About what one checkpoint of ``cfg`` holds: every parameter once, in the model's dtype (fp32 at ZeRO-3, whose
    shards stay fp32), plus its fp32 main copy and Adam moments; the RNG states, manifest and tokenizer are small."""
    weight = 4 if cfg.optimizer.zero_level == 3 else dtype_bytes(cfg)
    return parameter_count(cfg) * (weight + ADAM_CHECKPOINT_BYTES)


def parameter_count(cfg: MegaliteConfig) -> int:
    """The model's parameters (as :func:`megalite.planner.parameters.count_parameters`' ``total``), from one layer
    of each kind instead of every layer."""
    model = cfg.model
    ends = sum(t.full_numel for t in chunk_tensors(model, 1, 0, 0, True, True))
    return ends + sum(_layer_numel(model, i, full=True) * n for i, n in _layer_kinds(model, 0, model.num_layers))


def check_disk_space(cfg: MegaliteConfig) -> None:
    """--save's filesystem has room for one more checkpoint."""
    if not cfg.checkpoint.save:
        return
    needed, free = checkpoint_bytes(cfg), shutil.disk_usage(cfg.checkpoint.save).free
    if needed > free:
        raise ConfigError(f"{FLAG.save} {cfg.checkpoint.save}: a checkpoint needs ~{needed / GiB:,.2f} GiB "
                          f"({parameter_count(cfg):,} parameters x {needed / parameter_count(cfg):.0f} bytes: weights, "
                          f"fp32 main copy, Adam moments), and its filesystem has {free / GiB:,.2f} GiB free")


def is_no_space(error: BaseException) -> bool:
    """A write that failed for a full disk: ENOSPC anywhere in the error's chain, or its words (a failure another
    rank reported, or DCP's wrapped one)."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "no space left on device" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def no_space_message(cfg: MegaliteConfig, error: BaseException, written: Optional[str] = None) -> Optional[str]:
    """The one line for a save that failed for lack of space, or None when the disk is not the cause: the error says
    ENOSPC, or (torch's writer reports a short write as "unexpected pos") the filesystem now has less room than a
    checkpoint needs."""
    save = cfg.checkpoint.save
    if not save:
        return None
    needed = checkpoint_bytes(cfg)
    try:
        free = shutil.disk_usage(save).free
    except OSError:
        return None
    if not is_no_space(error) and free >= needed:
        return None
    return (f"no space left on device writing {written or save} (needs ~{needed / GiB:,.2f} GiB, "
            f"{free / GiB:,.2f} GiB free)")


# ---- memory ---------------------------------------------------------------------------------------------------------

def check_memory(cfg: MegaliteConfig, world_size: int, cuda: bool) -> None:
    """The planner's estimate of the most loaded stage fits this GPU and its offloaded states the host, or, on the
    CPU, the estimates of this node's ranks fit the host together. The floor first: it refuses the absurd cheaply."""
    layout = Layout.from_config(cfg, world_size)
    local = _local_pp_ranks(layout)   # the stage of each rank on this node
    floors = {r: _state_floor(cfg, layout, r, cuda) for r in set(local) | ({*range(layout.pp)} if cuda else set())}
    capacity, where = _capacity(cuda)
    floor = max(floors.values()) if cuda else sum(floors[r] for r in local)
    if floor > capacity:
        stage = max(floors, key=floors.get)
        raise ConfigError(f"the model does not fit {where}: its weights, gradients and optimizer states alone need at "
                          f"least {floor / GiB:,.1f} GiB {_ranks(cuda, local)} ({_rank_elements(cfg, layout, stage):,} "
                          f"parameters on a rank of stage {stage}) {_advice()}")
    _, stages = run_memory(cfg, world_size, cuda)
    if cuda:
        peak = max(stages, key=lambda s: s.total)
        if peak.total > capacity:
            raise ConfigError(f"the memory estimate does not fit {where}: stage {peak.pp_rank} needs {_split(peak)} "
                              f"per GPU {_advice()}")
        capacity, where = _capacity(False)
    needed = sum(stages[r].host + (0 if cuda else stages[r].total) for r in local)
    if needed > capacity:
        peak = max((stages[r] for r in local), key=lambda s: s.host + (0 if cuda else s.total))
        what = f"{peak.host / GiB:,.2f} GiB of offloaded states" if cuda else _split(peak, host=True)
        raise ConfigError(f"the memory estimate does not fit {where}: {needed / GiB:,.1f} GiB for "
                          f"{_ranks(False, local)} (stage {peak.pp_rank}: {what} per rank) {_advice()}")


def _split(stage: StageMemory, host: bool = False) -> str:
    """The stage's estimate and its parts, as --dry-run prints them (``host``: its offloaded states added)."""
    gathered = f" + gathered layers {stage.gathered / GiB:,.2f}" if stage.gathered else ""
    offloaded = f" + host states {stage.host / GiB:,.2f}" if host and stage.host else ""
    return (f"{(stage.total + (stage.host if host else 0)) / GiB:,.2f} GiB (weights {stage.weights / GiB:,.2f} + "
            f"gradients {stage.gradients / GiB:,.2f} + optimizer {stage.optimizer / GiB:,.2f}{gathered} + "
            f"activations {stage.activations / GiB:,.2f}{offloaded}, as {FLAG.dry_run} prints)")


def _advice() -> str:
    return (f"- shard or shrink it ({FLAG.dry_run} shows the split, tools/plan_parallelism.py a layout that fits), "
            f"or run anyway with {FLAG.skip_memory_check}")


def _ranks(cuda: bool, local: list[int]) -> str:
    return "per GPU" if cuda else f"for {len(local)} rank{'s' if len(local) > 1 else ''} on this host"


def _local_pp_ranks(layout: Layout) -> list[int]:
    """The pipeline stage of each rank on this node (torchrun's ranks of a node are consecutive; rank order puts PP
    outermost)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    per_stage = layout.world_size // layout.pp
    return [min(r // per_stage, layout.pp - 1) for r in range(first, first + local)]


def _capacity(cuda: bool) -> tuple[float, str]:
    """(bytes, words for the error) of what the run's memory must fit in: the GPU's memory, or the host's."""
    if cuda:
        device = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        total = torch.cuda.get_device_properties(device).total_memory
        return float(total), f"this GPU ({total / GiB:,.1f} GiB)"
    available = available_host_memory()
    return available, f"this host ({available / GiB:,.1f} GiB available)"


def available_host_memory() -> float:
    """Memory this process may still take: psutil's (when installed) or /proc/meminfo's MemAvailable, within a
    cgroup's limit (a container's) where there is one."""
    try:
        import psutil   # optional
        available = float(psutil.virtual_memory().available)
    except ImportError:
        available = _meminfo_available()
    return min(available, _cgroup_room())


def _meminfo_available() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))   # no /proc: the whole memory


def _cgroup_room() -> float:
    """A cgroup v2 memory limit less what the cgroup uses; infinite without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return float("inf")
    return float("inf") if limit == "max" else float(int(limit) - int(used))


def _state_floor(cfg: MegaliteConfig, layout: Layout, pp_rank: int, cuda: bool) -> float:
    """Model-state bytes a rank of stage ``pp_rank`` holds at least (on the GPU with ``cuda``, else all of them,
    host states included): its parameters times the bytes each costs (planner/memory.py's table), sharded as if
    every one were spread over all DP x CP ranks, without bucket padding or ZeRO-3's gathered layers."""
    r, zero, nbytes = layout.replicas, layout.zero, dtype_bytes(cfg)
    grad = 2 if cfg.optimizer.grad_reduce_in_bf16 else 4
    offload, params_offloaded = layout.optimizer_cpu_offload, layout.offload_params
    if zero == 3:
        weights = grads = 4 / r
        optimizer = (12 if offload else 8) / r
    else:
        weights, grads = nbytes, grad / (r if zero == 2 else 1)
        optimizer = (8 + (0 if nbytes == 4 and not offload else 4)) / (r if zero else 1)
    per_element = weights + grads + optimizer
    if cuda:
        per_element -= optimizer if offload else 0
        per_element -= weights + grads if params_offloaded else 0
    return _rank_elements(cfg, layout, pp_rank) * per_element


def _rank_elements(cfg: MegaliteConfig, layout: Layout, pp_rank: int) -> int:
    """Elements a rank of stage ``pp_rank`` holds (as count_parameters' ``per_stage``), one layer of each kind."""
    model, tp = cfg.model, layout.tp
    total = 0
    for chunk in chunks_of_rank(layout.split or model.num_layers, layout.pp, layout.virtual_stages, pp_rank,
                                layout.placement):
        total += sum(t.numel for t in chunk_tensors(model, tp, chunk.first_layer, 0, chunk.is_first, chunk.is_last))
        total += sum(_layer_numel(model, i, tp=tp, ep=layout.ep, expert_tp=layout.expert_tp) * n
                     for i, n in _layer_kinds(model, chunk.first_layer, chunk.num_layers))
    return total


def _layer_kinds(model, first: int, count: int) -> list[tuple[int, int]]:
    """(the index of one, how many) of each kind of layer, dense and MoE, among layers ``first`` .. on."""
    if not model.num_experts:
        return [(first, count)] if count else []
    moe = model.moe_layers()[first:first + count]
    return [(first + moe.index(kind), moe.count(kind)) for kind in (False, True) if kind in moe]


def _layer_numel(model, index: int, *, tp: int = 1, ep: int = 1, expert_tp: Optional[int] = None,
                 full: bool = False) -> int:
    """Elements of layer ``index`` on a rank at this TP and EP (``full``: canonical, every expert)."""
    return sum(t.full_numel if full else t.numel for t in layer_tensors(model, tp, index, ep, expert_tp))
