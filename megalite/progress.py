"""Progress for work that would otherwise run silently: a bar with the rate and the time left on a terminal, and the
ETA arithmetic the training log line uses too.

A bar is drawn on stderr only where someone watches it: the stream is a terminal, the process is rank 0 of its job
(``RANK`` unset or 0, so a job of 8 ranks draws one bar, not 8), and the caller did not ask for quiet (``--quiet``).
Off a terminal (a log file, a pipe) nothing is written, which is the convention for bars, unless the caller asks
for a plain line every so often there (``log_interval_s``: the preprocessor's status every 10 s in a batch job's
log). A bar appears only once its work has run for half a second, so quick work stays silent; it is redrawn at most
ten times a second, in place, and left on its own line with its final numbers when the work ends.

The time left is the elapsed time scaled by the work remaining over the work done (the mean rate so far): honest
for work done at a steady pace, which index building, token checks and checkpoint reads are.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Callable, Optional, TextIO, TypeVar

T = TypeVar("T")

_BAR_WIDTH = 24
DELAY_S = 0.5   # a bar appears once its work has run this long
_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def eta_seconds(done: float, total: float, elapsed_s: float) -> Optional[float]:
    """Seconds left for ``total`` units at the mean rate of the ``done`` ones so far; None before any is done."""
    if done <= 0:
        return None
    return max(total - done, 0.0) * elapsed_s / done


def format_duration(seconds: float) -> str:
    """``42s`` as ``0:42``, then ``12:05``, ``3:02:07``, ``2d 03:02:07`` (tqdm's style, days spelt out)."""
    whole = int(round(max(seconds, 0.0)))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def format_count(value: float) -> str:
    """1234 -> 1.23k, 5.6e6 -> 5.60M; below a thousand as it is (integers without a decimal point)."""
    for scale, suffix in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"


class MeanStepTime:
    """The mean seconds per step over the steps timed so far, and the time the remaining steps will take at it (the
    ETA on the training log line: evaluations and checkpoints, timed apart from steps, are not in it)."""

    def __init__(self):
        self.steps, self.seconds = 0, 0.0

    def add(self, steps: int, seconds: float) -> None:
        self.steps += steps
        self.seconds += seconds

    def eta(self, remaining_steps: int) -> Optional[float]:
        return eta_seconds(self.steps, self.steps + remaining_steps, self.seconds)


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def is_first_rank() -> bool:
    """Rank 0 of the job, or not in a job (``RANK`` as torchrun sets it)."""
    return os.environ.get("RANK", "0") == "0"


class Progress:
    """A bar for ``total`` units of work (None: unknown, then only the count and the rate are shown).

    ``enabled`` is the caller's say (False for --quiet); the bar is drawn only if, besides, ``stream`` (default
    stderr) is a terminal in rank 0 (off a terminal: a line every ``log_interval_s``, if given). ``note`` is shown
    after the numbers (other counts of the same work). Use it as a context manager, or call ``close`` at the end."""

    def __init__(self, total: Optional[float], description: str, unit: str = "", *, enabled: bool = True,
                 stream: Optional[TextIO] = None, delay_s: Optional[float] = None, interval_s: float = 0.1,
                 log_interval_s: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        self.total, self.description, self.unit = total, description, unit
        self.stream = stream if stream is not None else sys.stderr
        self.in_place = is_terminal(self.stream)
        self.visible = enabled and is_first_rank() and (self.in_place or log_interval_s is not None)
        if not self.in_place:
            delay_s = interval_s = log_interval_s or 0.0
        self.delay_s = DELAY_S if delay_s is None else delay_s
        self.interval_s, self.clock = interval_s, clock
        self.done = 0.0
        self.note = ""
        self.start = clock()
        self._drawn_at: Optional[float] = None
        self._closed = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, amount: float = 1) -> None:
        self.set(self.done + amount)

    def set(self, done: float) -> None:
        """The work done so far is ``done`` units."""
        self.done = done
        if not self.visible:
            return
        now = self.clock()
        if now - self.start < self.delay_s:
            return
        if self._drawn_at is None or now - self._drawn_at >= self.interval_s:
            self._draw(now, end="")

    def close(self) -> None:
        """Leave the final numbers on the bar's line (if it was ever drawn) and stop."""
        if self._closed:
            return
        self._closed = True
        if self.visible and self._drawn_at is not None:
            self._draw(self.clock(), end="\n")

    def line(self, now: Optional[float] = None) -> str:
        """The bar as text: ``what: 45% |#####      | 4.5k/10k tokens [0:03<0:04, 1.2k tokens/s]``."""
        elapsed = (self.clock() if now is None else now) - self.start
        unit = f" {self.unit}" if self.unit else ""
        rate = f"{format_count(self.done / elapsed)}{unit}/s" if elapsed > 0 else f"?{unit}/s"
        note = f" {self.note}" if self.note else ""
        if not self.total:
            return f"{self.description}: {format_count(self.done)}{unit} [{format_duration(elapsed)}, {rate}]{note}"
        fraction = min(self.done / self.total, 1.0)
        filled = int(fraction * _BAR_WIDTH)
        left = eta_seconds(self.done, self.total, elapsed)
        return (f"{self.description}: {fraction:4.0%} |{'#' * filled}{' ' * (_BAR_WIDTH - filled)}| "
                f"{format_count(self.done)}/{format_count(self.total)}{unit} "
                f"[{format_duration(elapsed)}<{'?' if left is None else format_duration(left)}, {rate}]{note}")

    def _draw(self, now: float, end: str) -> None:
        self._drawn_at = now
        if self.in_place:   # \033[K: clear what a longer line left
            self.stream.write("\r" + self.line(now) + "\033[K" + end)
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()


def track(items: Iterable[T], description: str, unit: str = "", *, total: Optional[float] = None,
          enabled: bool = True, stream: Optional[TextIO] = None) -> Iterator[T]:
    """``items`` one by one, with a bar counting them (``total`` defaults to ``len(items)`` where it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)   # type: ignore[arg-type]
    with Progress(total, description, unit, enabled=enabled, stream=stream) as bar:
        for item in items:
            yield item
            bar.update()
