"""A peer lost or a collective timed out: one line that says which, over which group, and which ranks are gone.

The backend's own error says little: gloo's "Connection closed by peer [10.0.0.2]:45312" names an address (and in a
cascade, only the neighbour that gave up first), a timeout names no one. Two cheap sources say more:

- the failing call itself: the innermost ``torch.distributed`` frame of the traceback holds its ``group`` (the layout
  names each group with torch's ``group_desc``, which NCCL's own watchdog messages print too);
- a roll call through torchrun's key-value store (it lives in the launcher of node 0, not in any worker): every rank
  runs a daemon thread that answers a call once made; the first rank to fail makes the call and waits a few seconds,
  and the ranks that never answer are the dead or stalled ones (a SIGSTOPped process answers nothing; one blocked in
  a collective does, its thread runs while the main thread waits in C++). Answers stay in the store, so a rank that
  fails later, in the cascade, names the same lost ranks rather than the survivors that already exited.

On gloo both work: collectives block the main thread, so the error reaches pretrain_gpt. On NCCL a collective is
asynchronous and a failure is seen by torch's watchdog thread, which ends the process itself; there the Flight
Recorder (:func:`nccl_flight_recorder_defaults`) keeps the evidence.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from typing import Optional

import torch.distributed as dist

# What the backends say when the other end of a connection went away (gloo's pair.cc, NCCL's socket layer and
# ncclRemoteError), lower case.
PEER_LOST = ("connection closed by peer", "connection closed by remote peer", "connection reset by peer",
             "broken pipe", "remote process exited", "ncclremoteerror")
# gloo: "Timed out waiting 6000ms for recv operation"; NCCL's watchdog: "Watchdog caught collective operation timeout".
TIMED_OUT = ("timed out", "collective operation timeout")

ROLL_CALL_POLL_S = 0.5   # how often an idle rank looks for a call: one cheap store request per rank
ROLL_CALL_WAIT_S = 5.0   # how long the caller waits for answers; 10x the poll, so a live rank answers in time


def failure_kind(error: BaseException) -> Optional[str]:
    """"peer lost", "timed out", or None when ``error`` is neither (then it is not the network's doing)."""
    text = str(error).lower()
    if any(words in text for words in PEER_LOST):
        return "peer lost"
    if any(words in text for words in TIMED_OUT):
        return "timed out"
    return None


def backend_words(error: BaseException) -> str:
    """The backend's message, short: its first line, without gloo's "[.../pair.cc:553] " source location and its
    advice after the first sentence."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    return re.split(r"(?<=\S)\. (?=[A-Z])", line, maxsplit=1)[0].rstrip(".")


def failed_collective(error: BaseException) -> Optional[str]:
    """"all_reduce over the tensor group (ranks [0, 1])" for the torch.distributed call the error came out of, read
    from its traceback; None when it came from elsewhere (e.g. a Work waited for later)."""
    call = None
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_filename.endswith("distributed_c10d.py") and "group" in frame.f_code.co_varnames:
            call = (frame.f_code.co_name, frame.f_locals.get("group"))
        traceback = traceback.tb_next
    if call is None:
        return None
    name, group = call
    try:
        group = group or dist.group.WORLD
        description = getattr(group, "group_desc", "")
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, AttributeError):   # the group is already torn down
        return name
    kind = "world" if group is dist.group.WORLD or description in ("", "default_pg") else description
    return f"{name} over the {kind} group (ranks {ranks})"


def rank_ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7": a node's worth of lost ranks stays short."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


class RollCall:
    """This rank's part in finding who is gone: it answers a call from a daemon thread, and makes one on failure.

    ``store`` is a client of its own (a blocking request holds the client's lock, so the process group's store is not
    shared); keys live under this torchrun attempt's prefix. :meth:`stop` ends the thread before the process exits:
    a daemon thread still inside a store request when Python finalizes is ended by ``pthread_exit``, whose unwinding
    through pybind11's GIL guard aborts the process ("terminate called without an active exception", SIGABRT) after a
    run that succeeded."""

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._answer_when_called, name="megalite-roll-call", daemon=True)
        self._thread.start()

    @classmethod
    def join(cls) -> Optional["RollCall"]:
        """The roll call of this torchrun rank (None outside torchrun, or where its store cannot be reached)."""
        if not dist.is_initialized() or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=30))
        except (RuntimeError, ValueError):
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"megalite/attempt{attempt}/roll_call", store), dist.get_rank(),
                   dist.get_world_size())

    def _answer(self) -> None:
        self.store.set(f"here/{self.rank}", "1")
        self.store.add("answered", 1)

    def _answer_when_called(self) -> None:
        try:
            while not self.store.check(["called"]):
                if self._stopped.wait(ROLL_CALL_POLL_S):
                    return
            self._answer()
        except Exception:   # the store went away (the job ended): nothing left to answer
            return

    def stop(self) -> None:
        """End the answering thread: at most one poll and one store request (bounded by the store's timeout)."""
        self._stopped.set()
        self._thread.join(timeout=ROLL_CALL_WAIT_S)

    def missing(self, wait_s: float = ROLL_CALL_WAIT_S) -> Optional[list[int]]:
        """Call the roll (once per attempt, whoever calls first) and return the ranks that did not answer within
        ``wait_s`` (None if the store cannot be reached: the launcher of node 0 is gone too)."""
        try:
            if not self.store.check([f"here/{self.rank}"]):
                self.store.set("called", "1")
                self._answer()   # our own thread may still be asleep
            deadline = time.monotonic() + wait_s
            while self.store.add("answered", 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
            return [r for r in range(self.world_size) if not self.store.check([f"here/{r}"])]
        except Exception:   # DistStoreError and friends: no store, no names
            return None


def failure_line(error: BaseException, rank: int, timeout_minutes: float,
                 roll_call: Optional[RollCall] = None) -> Optional[str]:
    """The one line for a lost peer or a timed-out collective (None for any other error: not ours to explain)."""
    kind = failure_kind(error)
    if kind is None:
        return None
    where = failed_collective(error)
    if kind == "peer lost":
        head = f"lost a peer{' in ' + where if where else ''}: another rank died or its node went down"
    else:
        head = (f"a collective timed out after --distributed-timeout-minutes {timeout_minutes:g}: another rank died "
                f"or stalled{' (' + where + ')' if where else ''}")
    missing = roll_call.missing() if roll_call is not None else None
    if missing:
        head += f"; rank(s) {rank_ranges(missing)} did not answer a roll call through torchrun's store: see their logs"
    elif missing == []:
        head += "; every rank answered a roll call through torchrun's store (a network fault, or a rank that stalled "
        head += "and came back)"
    return f"megalite: error: rank {rank}: {head} ({backend_words(error)})"


def nccl_flight_recorder_defaults(environ: dict) -> dict[str, str]:
    """The Flight Recorder settings an NCCL run gets unless the user set them: a ring of the last 2000 collectives per
    rank (cheap: host-side records), dumped on a timeout to /tmp/nccl_trace_rank_<R>; ``torchfrtrace DIR -p
    nccl_trace_rank_`` then names, per group, the ranks that did not join the collective. Returns what was added."""
    added = {name: value for name, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
                                             ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")) if name not in environ}
    environ.update(added)
    return added
