"""Progress bars and the ETA arithmetic: the numbers, when a bar is drawn (a terminal, rank 0, not quiet, after the
delay, at most every interval) and what it leaves behind; a fake clock and a fake terminal stand in for time and
the screen."""

from __future__ import annotations

import io

import pytest

from megalite.progress import MeanStepTime, Progress, eta_seconds, format_count, format_duration, track


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_eta_arithmetic():
    assert eta_seconds(25, 100, 10.0) == pytest.approx(30.0)     # a quarter in 10 s: 30 s to go
    assert eta_seconds(100, 100, 10.0) == 0.0 and eta_seconds(0, 100, 5.0) is None
    steps = MeanStepTime()
    steps.add(10, 5.0)      # 0.5 s per step
    steps.add(5, 5.0)       # 1 s per step: the mean is 10 s / 15 steps
    assert steps.eta(30) == pytest.approx(20.0)
    assert MeanStepTime().eta(10) is None


def test_formats():
    assert [format_duration(s) for s in (0, 42, 725, 3 * 3600 + 127, 2 * 86400 + 3 * 3600 + 127)] == \
        ["0:00", "0:42", "12:05", "3:02:07", "2d 03:02:07"]
    assert [format_count(v) for v in (7, 0.5, 1234, 5.6e6, 3e9)] == ["7", "0.5", "1.23k", "5.6M", "3G"]


def test_a_bar_appears_after_the_delay_redraws_at_most_every_interval_and_ends_with_its_numbers(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    screen, clock = Terminal(), Clock()
    bar = Progress(10_000, "checking", "tokens", stream=screen, clock=clock)
    bar.update(1000)
    assert screen.getvalue() == ""               # quick work stays silent
    clock.now += 3.0
    bar.update(3500)                             # 4.5k of 10k in 3 s: 1.5k/s, 3.67 s to go
    assert screen.getvalue() == "\r" + bar.line() + "\033[K"
    assert bar.line() == "checking:  45% |##########              | 4.5k/10k tokens [0:03<0:04, 1.5k tokens/s]"
    clock.now += 0.05
    bar.update(100)
    assert screen.getvalue().count("\r") == 1    # within the interval: not redrawn
    clock.now += 0.1
    bar.update(5400)
    bar.close()
    bar.close()
    lines = screen.getvalue().split("\r")
    assert len(lines) == 4 and lines[-1].startswith("checking: 100%") and lines[-1].endswith("\033[K\n")


@pytest.mark.parametrize("why", ["quiet", "not a terminal", "rank 1"])
def test_no_bar_unless_someone_watches(monkeypatch, why):
    monkeypatch.setenv("RANK", "1" if why == "rank 1" else "0")
    screen, clock = (io.StringIO() if why == "not a terminal" else Terminal()), Clock()
    with Progress(10, "x", stream=screen, clock=clock, enabled=why != "quiet") as bar:
        clock.now += 5
        bar.update(10)
    assert screen.getvalue() == ""


def test_off_a_terminal_a_line_every_log_interval_when_asked(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    log, clock = io.StringIO(), Clock()
    with Progress(None, "tokenizing", "bytes", stream=log, clock=clock, log_interval_s=10.0) as bar:
        for _ in range(25):
            clock.now += 1.0
            bar.note = "3 docs"
            bar.update(1000)
    assert log.getvalue().splitlines() == ["tokenizing: 10k bytes [0:10, 1k bytes/s] 3 docs",
                                           "tokenizing: 20k bytes [0:20, 1k bytes/s] 3 docs",
                                           "tokenizing: 25k bytes [0:25, 1k bytes/s] 3 docs"]


def test_track_counts_the_items(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert list(track(range(5), "x", stream=Terminal())) == [0, 1, 2, 3, 4]
