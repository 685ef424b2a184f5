"""Keeping the ranks of a distributed test launch in step, so that a failure fails instead of hanging.

Every rank runs the same pytest session. Three mechanisms keep one rank's failure from stranding the others:

- Short timeouts. The world group gets ``COLLECTIVE_TIMEOUT_S`` and every group built from it inherits that timeout
  (``parallel_state`` passes the world's timeout on), so a rank waiting in a collective for a peer that left the test
  raises within a minute instead of gloo's default half hour.
- Agreement. After each test's setup and call phase, the ranks gather their outcomes over a group of their own that
  no test uses; if any rank failed, the test fails on every rank, with the failing ranks' reports attached (rank 0's
  report is the one the launch shows). A gloo group that timed out is dead on both sides, so after a failure the world
  is rebuilt (under a fresh store prefix) before the next test.
- A watchdog. A test that makes no progress for ``WATCHDOG_S`` seconds (a wait no timeout covers) ends the launch:
  rank 0 prints which test every rank is in and its own stack, then every rank exits non-zero.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megalite import parallel_state

# Longest legitimate wait inside one collective of a test (the ranks of a test do the same work, but 8 ranks share
# 2 cores); a rank stranded by a failed peer raises after this.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("MEGALITE_TEST_COLLECTIVE_TIMEOUT_S", "120"))
# Longest a test may run on one rank (the slowest took 14 s on 2 cores with 4 ranks, 17 s with 8). The agreement may wait
# that long: ranks outside a test's layout wait there while its members train.
WATCHDOG_S = float(os.environ.get("MEGALITE_TEST_WATCHDOG_S", "180"))
# A non-zero rank whose watchdog fires waits this long for rank 0 to print the report before it exits (torchrun stops
# every rank once one exits).
REPORT_GRACE_S = 20.0
_REPORT_LINES = 40


@dataclass
class _Outcome:
    nodeid: str
    when: str
    outcome: str       # "passed", "failed" or "skipped"
    text: str          # the tail of the failure report, empty otherwise


class Lockstep:
    """This rank's membership of the launch: the store, the world group and the agreement group."""

    def __init__(self, config):
        self.config = config
        # The store outlives the groups, so the world can be rebuilt on it after a failure.
        self.store, self.rank, self.size = next(dist.rendezvous(
            "env://", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)))
        self.generation = 0
        self.agreement: Optional[dist.ProcessGroup] = None
        self.needs_rebuild = False
        self._current = "<session start>"
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._join()
        threading.Thread(target=self._watch, name="test-watchdog", daemon=True).start()

    # ---- the world -------------------------------------------------------------------------------------------------
    def _join(self) -> None:
        store = dist.PrefixStore(f"tests/world{self.generation}", self.store)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # Outcomes are gathered on a group no test touches, so a test's dead groups cannot take it down. It waits
        # longer than a test may run (ranks outside a test's layout reach it before the members): a rank that never
        # arrives is the watchdog's to report.
        self.agreement = dist.new_group(timeout=datetime.timedelta(seconds=WATCHDOG_S + 3 * REPORT_GRACE_S))

    def rebuild(self) -> None:
        """Replace every group (a gloo group that timed out is closed on both sides); all ranks call this together."""
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        self.generation += 1
        self._join()
        self.needs_rebuild = False

    def leave(self) -> None:
        """End the session, after pytest has printed its summary (called at unconfigure): every rank waits for the
        others first, so that a rank which failed and exits with 1 cannot make torchrun kill rank 0 (whose report
        the launch shows) before rank 0 has printed which tests failed and why."""
        self.progress("<session end>")
        parallel_state.destroy_model_parallel()
        try:
            dist.barrier(group=self.agreement)
        except Exception:   # noqa: BLE001 - a rank already gone: nothing left to wait for
            pass
        dist.destroy_process_group()

    # ---- agreement -------------------------------------------------------------------------------------------------
    def agree(self, report) -> None:
        """Gather every rank's outcome of this phase; fail it everywhere if it failed anywhere."""
        mine = _Outcome(report.nodeid, report.when, report.outcome,
                        _tail(report.longreprtext) if report.failed else "")
        everyone: list[Optional[_Outcome]] = [None] * self.size
        try:
            dist.all_gather_object(everyone, mine, group=self.agreement)
        except Exception as error:   # noqa: BLE001 - the ranks can no longer agree: nothing after this is in step
            self._end(f"the ranks could not agree on the outcome of {report.nodeid} ({report.when}): {error}")
        if any((o.nodeid, o.when) != (mine.nodeid, mine.when) for o in everyone):
            where = ", ".join(f"rank {r}: {o.nodeid} ({o.when})" for r, o in enumerate(everyone))
            _fail(report, f"the ranks are in different tests ({where}): their collections differ")
            self.needs_rebuild = True
            return
        failed = [r for r, o in enumerate(everyone) if o.outcome == "failed"]
        outcomes = {o.outcome for o in everyone}
        if not failed and len(outcomes) > 1 and report.when == "setup":
            # Some ranks would run the test and others not: the runners would wait for the others forever.
            _fail(report, "setup outcomes differ across ranks: "
                  + ", ".join(f"rank {r} {o.outcome}" for r, o in enumerate(everyone)))
            return
        if not failed:
            return
        self.needs_rebuild = True
        others = [r for r in failed if r != self.rank]
        sections = [f"---- rank {r} ----\n{everyone[r].text}" for r in others]
        header = f"{report.when} failed on rank(s) {', '.join(map(str, failed))} of {self.size}"
        if report.failed:
            report.sections.append((f"also failed on rank(s) {', '.join(map(str, others))}" if others else header,
                                    "\n".join(sections)))
        else:
            _fail(report, header + "\n" + "\n".join(sections))

    # ---- the watchdog ----------------------------------------------------------------------------------------------
    def progress(self, what: str) -> None:
        with self._lock:
            self._current, self._since = what, time.monotonic()
        try:
            self.store.set(f"tests/now/{self.rank}", what)
        except Exception:   # noqa: BLE001 - the store is only for the watchdog's report
            pass

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                current, stalled = self._current, time.monotonic() - self._since
            if stalled < WATCHDOG_S:
                continue
            self._end(f"watchdog: no progress for {stalled:.0f} s in {current} "
                      f"(limit {WATCHDOG_S:.0f} s, MEGALITE_TEST_WATCHDOG_S)")

    def _end(self, reason: str) -> None:
        """End the launch: rank 0 prints ``reason``, where every rank is and its own stack; every rank exits 3."""
        if self.rank != 0:
            time.sleep(REPORT_GRACE_S)   # torchrun stops every rank once one exits: let rank 0 report first
            os._exit(3)
        capture = self.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=True)   # stdout/stderr are captured into files during a test
        lines = [f"{reason}; ending the launch. Where each rank is:"]
        for r in range(self.size):
            try:
                where = self.store.get(f"tests/now/{r}").decode() if self.store.check([f"tests/now/{r}"]) else "?"
            except Exception:   # noqa: BLE001
                where = "?"
            lines.append(f"  rank {r}: {where}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(3)


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-_REPORT_LINES:])


def _fail(report, message: str) -> None:
    report.outcome = "failed"
    report.longrepr = message
