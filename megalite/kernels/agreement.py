"""The fused kernels are built and self-checked once, before training, and every rank of the world runs the same ops.

An op that one rank runs fused and another as torch ops computes slightly differently on the two (the kernels round
unlike torch's ops), and tensor-parallel ranks that differ diverge silently. So each rank builds the extension and
self-checks its kernels on its device (:mod:`megalite.kernels.self_check`), and the verdicts are agreed over the
world in one all_reduce (MIN) of a flags tensor: an op that failed on any rank runs as torch ops on every rank, and
rank 0 prints one line naming the op, the first rank where it failed and why.

Under ``--use-fused-kernels on`` a rank where the extension does not build or a kernel fails raises at once, before
any collective (on a machine without a working toolkit every rank does so alike). A rank waiting on another's build
waits up to the distributed timeout (the build lock's bound, see megalite.extensions), as long as the collective
after it would wait for that rank anyway.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from megalite.extensions import ExtensionUnavailable
from megalite.kernels import self_check
from megalite.kernels.policy import EXTENSION_NAME, EXTENSION_SOURCES, OPS, KernelPolicy, fused_extension


def prepare(policy: KernelPolicy, device: torch.device, lock_timeout_s: float | None = None) -> KernelPolicy:
    """``policy`` resolved for a run on ``device``, the same on every rank: call it on every rank (after the process
    group exists, before the model runs). CPU tensors run torch ops: on a CPU device (or with nothing enabled)
    nothing is built or agreed, alike on every rank."""
    if device.type != "cuda" or not any(policy.enabled(op) for op in OPS):
        return policy
    return resolve(policy, device, lock_timeout_s)


def resolve(policy: KernelPolicy, device: torch.device, lock_timeout_s: float | None = None) -> KernelPolicy:
    """:func:`prepare`'s work on any device (the tests run it on the CPU, with a stand-in extension): build,
    self-check, agree over the world; the returned policy holds the extension and has the failed ops disabled."""
    extension, failures = local_verdict(policy, device, lock_timeout_s)
    failed = agree(failures, device)
    if failed:
        reasons = _reasons_of_first_failures(failed, failures, device)
        if _rank() == 0:
            for line in failure_lines(failed, reasons):
                print(line, file=sys.stderr, flush=True)
    return dataclasses.replace(policy, disabled=policy.disabled | frozenset(failed), extension=extension)


def local_verdict(policy: KernelPolicy, device: torch.device,
                  lock_timeout_s: float | None = None) -> tuple[types.ModuleType | None, dict[str, str]]:
    """(the extension or None, {op: why} for the enabled ops that cannot run fused on this rank); under ``on`` any
    such op raises here (:class:`ExtensionUnavailable`, or its KernelSelfCheckFailed)."""
    enabled = [op for op in OPS if policy.enabled(op)]
    try:
        extension = fused_extension(required=True, lock_timeout_s=lock_timeout_s)
    except ExtensionUnavailable as error:
        if policy.mode == "on":
            raise
        return None, {op: str(error) for op in enabled}
    failures = {op: why for op, why in self_check.failed_ops(extension, device, EXTENSION_NAME,
                                                             EXTENSION_SOURCES).items() if op in enabled}
    if failures and policy.mode == "on":
        raise self_check.refuse(failures, device)
    return extension, failures


def verdict_flags(failed: Collection[str], rank: int, world_size: int) -> list[int]:
    """One rank's flags, per op of OPS: ``world_size`` where it can run fused here, else this rank. Their MIN over
    the ranks is, per op, the first rank where it failed, or ``world_size`` where it passed everywhere."""
    return [rank if op in failed else world_size for op in OPS]


def agreed_failures(min_flags: Sequence[int], world_size: int) -> dict[str, int]:
    """{op: first rank where it failed} from the MIN of every rank's :func:`verdict_flags`."""
    return {op: int(first) for op, first in zip(OPS, min_flags, strict=True) if first < world_size}


def agree(failed: Collection[str], device: torch.device) -> dict[str, int]:
    """{op: first rank where it failed} over every rank of the world, the same on each: one all_reduce (MIN) of a
    flags tensor created on the compute device (NCCL serves device tensors only)."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    flags = torch.tensor(verdict_flags(failed, _rank(), world_size), dtype=torch.int64, device=device)
    if world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return agreed_failures(flags.tolist(), world_size)


def failure_lines(failed: Mapping[str, int], reasons: Mapping[str, str]) -> list[str]:
    """One line per (rank, reason): the ops it switched off on every rank."""
    groups: dict[tuple[int, str], list[str]] = {}
    for op, rank in failed.items():
        groups.setdefault((rank, reasons[op]), []).append(op)
    return [f"megalite: fused kernels {', '.join(ops)} run as torch ops on every rank: rank {rank}: {why}"
            for (rank, why), ops in groups.items()]


def _reasons_of_first_failures(failed: Mapping[str, int], failures: Mapping[str, str],
                               device: torch.device) -> dict[str, str]:
    """Why each failed op failed on its first failing rank: that rank's verdict, broadcast to all (every rank knows
    ``failed``, so every rank takes part in the same broadcasts)."""
    reasons = {}
    for source in sorted(set(failed.values())):
        holder = [dict(failures)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(holder, src=source, device=device)
        reasons.update({op: holder[0][op] for op, rank in failed.items() if rank == source})
    return reasons


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
