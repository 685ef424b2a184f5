"""Where checkpoints live on disk, and how a save becomes visible all at once.

    SAVE_DIR/
        iter_0000005/                       one complete checkpoint: manifest.json, DCP's .metadata and files
        iter_0000010/
        latest_checkpointed_iteration.txt   "10": the checkpoint --load resumes from (Megatron's name and format)

A save writes into ``iter_0000010.tmp.PID@HOST[@JOB]/`` (named after rank 0's process and job, see
:class:`megalite.checkpoint.lock.Owner`); once every rank's files and the manifest are in it, rank 0 renames it to
``iter_0000010/`` and only then rewrites the pointer file (a temporary file renamed over it). Renames are atomic, so
a crash at any moment, kill -9 included, leaves the pointer naming the previous complete checkpoint; the leftover
``.tmp.*`` directory is never read, and a later save of the same job (or any save once its owner's process is seen
dead on this host) removes it. Another job's is never touched: ``SAVE/.megalite.lock`` keeps a second job out of
the directory, and the names keep one that got in anyway (or a tool writing there) from deleting this one's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.lock import Owner
from megalite.checkpoint.manifest import MANIFEST_NAME

POINTER_NAME = "latest_checkpointed_iteration.txt"
TEMPORARY_SUFFIX = ".tmp"
_ITERATION_DIR = re.compile(r"iter_(\d+)")


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def temporary_dir(final: Path, owner: Owner) -> Path:
    return final.with_name(f"{final.name}{TEMPORARY_SUFFIX}.{owner.tag}")


# What marks an iteration directory of Megatron-LM (same pointer file, other contents): its torch_dist format's
# common state and format file, or its legacy format's per-rank directories.
MEGATRON_COMMON, MEGATRON_FORMAT_FILE = "common.pt", "metadata.json"
MEGATRON_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


def megatron_format(directory: Path) -> Optional[str]:
    """"torch_dist" (or the other backend its format file names) or "torch" (legacy) for an iteration directory of
    Megatron-LM; None for anything else (megalite's own have a manifest)."""
    if (directory / MANIFEST_NAME).exists() or not directory.is_dir():
        return None
    if (directory / MEGATRON_COMMON).is_file() and (directory / MEGATRON_FORMAT_FILE).is_file():
        try:
            return json.loads((directory / MEGATRON_FORMAT_FILE).read_text()).get("sharded_backend") or "unknown"
        except (OSError, ValueError):
            return "unknown"
    return "torch" if any(MEGATRON_RANK_DIR.fullmatch(p.name) for p in directory.iterdir()) else None


def _refuse_megatron(load: str | os.PathLike, directory: Path) -> None:
    kind = megatron_format(directory)
    if kind is not None:
        raise CheckpointError(f"--load {load}: a Megatron-LM checkpoint ({kind} format); import it first: python "
                              f"tools/convert_checkpoint.py import-megatron --input {load} --save DIR, then --load DIR")


def find_checkpoint(load: str | os.PathLike, allow_none: bool = False) -> Optional[Path]:
    """The checkpoint directory ``--load`` means: the one the pointer file names, or ``load`` itself if it is a
    checkpoint directory. Returns None when there is no checkpoint at all and ``allow_none`` (a run whose --load is
    its own --save, started for the first time); raises a one-line CheckpointError otherwise (naming the command
    that imports a Megatron-LM checkpoint when it is one)."""
    root = Path(load)
    _refuse_megatron(load, root)
    if (root / MANIFEST_NAME).exists() or (root / ".metadata").exists():
        return root   # a checkpoint directory itself (completeness is checked by the caller)
    pointer = root / POINTER_NAME
    if pointer.is_file():
        try:
            iteration = int(pointer.read_text().strip())
        except (OSError, ValueError):
            _refuse_megatron(load, root / "release")   # Megatron's pointer may say "release"
            raise CheckpointError(f"{pointer}: unreadable (expected an iteration number)") from None
        directory = iteration_dir(root, iteration)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: missing (named by {pointer})")
        _refuse_megatron(load, directory)
        return directory
    if allow_none and not _complete_iterations(root):
        return None
    if not root.is_dir():
        raise CheckpointError(f"--load {root}: no such directory")
    found = _complete_iterations(root)
    if found:
        raise CheckpointError(f"--load {root}: no {POINTER_NAME}; choose a checkpoint, e.g. --load {found[-1]}")
    raise CheckpointError(f"--load {root}: no checkpoint there (no {POINTER_NAME} or {MANIFEST_NAME})")


def pointed_iteration(root: str | os.PathLike) -> Optional[int]:
    """The iteration ``root``'s pointer file names; None without a readable one."""
    try:
        return int((Path(root) / POINTER_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def _complete_iterations(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _ITERATION_DIR.fullmatch(p.name) and (p / MANIFEST_NAME).is_file())


def prepare(final: Path, owner: Optional[Owner] = None) -> Path:
    """(Rank 0, before a save.) An empty temporary directory for ``final``, named after ``owner`` (this process by
    default). Leftovers of interrupted saves in the same root are removed when they were this job's or their owner
    is seen dead on this host (they were never complete, and nothing reads them); another job's are left alone."""
    owner = owner or Owner.current()
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in final.parent.glob(f"iter_*{TEMPORARY_SUFFIX}.*"):
        writer = Owner.from_tag(leftover.name.split(TEMPORARY_SUFFIX + ".", 1)[1])
        if writer is not None and (owner.same_job(writer) or writer.is_dead_here()):
            shutil.rmtree(leftover, ignore_errors=True)
    temporary = temporary_dir(final, owner)
    temporary.mkdir()
    return temporary


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync, so that a later rename cannot expose an empty file after a power loss."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(temporary: Path, final: Path, iteration: int) -> None:
    """(Rank 0, after every rank's files and the manifest are in ``temporary``.) Rename it into place, then point
    the pointer file at it. Saving an iteration that already exists (a rerun) moves the old one aside first: were
    the process killed right between the two renames, the pointer would name a missing directory and --load would
    say so, with the old checkpoint kept at ``iter_N.replaced``."""
    _fsync_dir(temporary)
    replaced = final.with_name(final.name + ".replaced")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(temporary, final)
    pointer = final.parent / POINTER_NAME
    staged = pointer.with_name(f".{POINTER_NAME}.{os.getpid()}{TEMPORARY_SUFFIX}")
    write_file(staged, f"{iteration}\n".encode())
    os.replace(staged, pointer)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
