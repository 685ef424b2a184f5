"""One job per ``--save`` directory: an exclusive lock file, and who owns a save's temporary directory.

``SAVE/.megalite.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on local disks and on NFSv3 and later, across
nodes; ``flock`` is not: on many NFS and Lustre mounts it locks only within one node) and holds its owner as JSON:
host, pid, job (torchrun's ``TORCHELASTIC_RUN_ID``, shared by all of a job's ranks and kept over its restarts; none
for a plain process or torchrun's default ``none``) and start time. A file outlives a killed owner, so a lock found
in place is judged:

- the same job (same run id: a torchrun restart after a failure), or this very process: taken over;
- an owner on this host whose pid is dead: stale, taken over, and said so;
- an owner on another host (whose pid cannot be checked from here): refused unless ``--break-save-lock``;
- a live owner on this host: refused.

Taking over renames the old file aside and checks that what was moved is what was judged, so that two jobs taking
over the same stale lock at once cannot both win (a third job's fresh lock moved by mistake is put back).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from megalite.checkpoint.errors import CheckpointError

LOCK_NAME = ".megalite.lock"


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who holds a lock or writes a temporary checkpoint directory."""
    host: str
    pid: int
    job: Optional[str] = None   # torchrun's run id; None where it names no job (a plain process, "none")
    started: float = 0.0        # seconds since the epoch

    @classmethod
    def current(cls) -> "Owner":
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        return cls(socket.gethostname(), os.getpid(), job if job and job != "none" else None, time.time())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "?"
        return f"host {self.host}, pid {self.pid}, job {self.job or '-'}, since {when}"

    @property
    def tag(self) -> str:
        """This owner in a file name: ``PID@HOST`` and, for a job, ``@`` and 8 hex digits of its run id."""
        job = f"@{hashlib.sha1(self.job.encode()).hexdigest()[:8]}" if self.job else ""
        return f"{self.pid}@{self.host}{job}"

    @classmethod
    def from_tag(cls, tag: str) -> Optional["Owner"]:
        """The owner a :attr:`tag` names (its job as the 8 hex digits), or None for anything else."""
        pid, _, rest = tag.partition("@")
        host, _, job = rest.partition("@")
        if not pid.isdigit() or not host:
            return None
        return cls(host, int(pid), job or None)

    def same_job(self, other: "Owner") -> bool:
        """Whether ``other`` is this process, or an earlier attempt of this job (a tag's job is its digest)."""
        if self.host == other.host and self.pid == other.pid:
            return True
        if self.job is None or other.job is None:
            return False
        return other.job in (self.job, hashlib.sha1(self.job.encode()).hexdigest()[:8])

    def is_dead_here(self) -> bool:
        """Whether this owner ran on this host and its process is gone (a zombie counts as gone)."""
        return self.host == socket.gethostname() and not _alive(self.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    try:   # Linux: an exited child its parent has not reaped yet still answers kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _read(path: Path) -> Optional[Owner]:
    """The owner the lock file names; None if it is gone. A file just created may still be empty: retried briefly."""
    for _ in range(20):
        try:
            text = path.read_text()
            fields = json.loads(text)
            return Owner(str(fields["host"]), int(fields["pid"]), fields.get("job"), float(fields.get("started", 0)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    raise CheckpointError(f"{path}: unreadable lock file; if no job writes to {path.parent}, remove it")


def _create(path: Path, owner: Owner) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(owner), f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _move_aside(path: Path, judged: Owner, me: Owner) -> bool:
    """Remove the lock file if it still names ``judged``; whether it did."""
    aside = path.with_name(f"{LOCK_NAME}.{me.tag}.stale")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return False   # another job took it over first
    try:
        if _read(aside) == judged:
            return True
        try:   # a fresh lock that replaced the judged one between our read and our rename: put it back
            os.link(aside, path)
        except FileExistsError:
            pass
        return False
    finally:
        aside.unlink(missing_ok=True)


class SaveLock:
    """The lock of one ``--save`` directory, held by rank 0 of the job from start-up to exit."""

    def __init__(self, path: Path, owner: Owner):
        self.path, self.owner = path, owner

    @classmethod
    def acquire(cls, save: str | os.PathLike, break_lock: bool = False,
                owner: Optional[Owner] = None) -> tuple["SaveLock", Optional[str]]:
        """Take the lock of ``save`` (created if missing) for ``owner`` (this process by default): the lock and a
        line to print when an earlier owner's lock was taken over; a one-line CheckpointError naming the owner
        when another job holds it. ``break_lock`` (--break-save-lock): take it from any owner."""
        me = owner or Owner.current()
        path = Path(save) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if _create(path, me):
                return cls(path, me), None
            held = _read(path)
            if held is None:
                continue   # released meanwhile
            if me.same_job(held):
                why = None if held.pid == me.pid and held.host == me.host else "an earlier attempt of this job"
            elif held.is_dead_here():
                why = "its process is gone"
            elif break_lock:
                why = "--break-save-lock"
            elif held.host == me.host:
                raise CheckpointError(f"--save {save}: in use by another job ({held.describe()}, lock {path}); "
                                      f"wait for it to end or choose another --save")
            else:
                raise CheckpointError(f"--save {save}: in use by another job ({held.describe()}, lock {path}), on "
                                      f"another host where it cannot be checked from here; if that job is gone, "
                                      f"rerun with --break-save-lock")
            if _move_aside(path, held, me) and _create(path, me):
                line = f"megalite: --save {save}: took over the lock of {held.describe()} ({why})" if why else None
                return cls(path, me), line
        raise CheckpointError(f"--save {save}: could not take the lock {path} (other jobs keep taking it)")

    def release(self) -> None:
        """Remove the lock file if it is still this owner's (one broken by --break-save-lock is not)."""
        try:
            if _read(self.path) == self.owner:
                self.path.unlink()
        except (OSError, CheckpointError):
            pass
