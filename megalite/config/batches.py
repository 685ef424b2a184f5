"""The global batch size over training, and the training's length: Megatron's rules as pure functions of the config.

- constant: ``--global-batch-size`` G every iteration;
- ``--rampup-batch-size START INCR SAMPLES`` (Megatron's ``RampupBatchsizeNumMicroBatchesCalculator``): with
  N = (G - START) / INCR increments, after c consumed samples the batch is START + INCR x int(c / (SAMPLES / N))
  while c <= SAMPLES, then G;
- ``--step-batch-size-schedule 'T0:B0 T1:B1 ...'`` (Megatron's ``StepBatchsizeNumMicroBatchesCalculator``): B_i from
  T_i tokens (T_i // seq length samples) on, T_0 = 0; thresholds take K/M/B/T suffixes (1e3 ... 1e12).

Either way a schedule is a list of steps (first consumed sample, batch size), so everything below is arithmetic over
a handful of segments however long the run. An iteration's batch depends only on the samples consumed before it:
every iteration takes the next samples of the one global order (megalite.data.sampler), so the data, and a run
resumed from a checkpoint (which holds the consumed samples), are exactly those of an uninterrupted run at any layout.

The length: ``--train-iters`` N, or ``--train-samples`` S converted as Megatron's ``update_train_iters`` does it:
iterations are counted through the ramp while the consumed samples stay <= the ramp's end and <= S (so the last
ramp iteration may pass S), then (S - consumed) // final batch more; a partial last batch is dropped. Megatron
refuses a ramp with ``--train-iters`` (its own GPT-3 175B example passes both); here it means N iterations of the
ramping batch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from megalite.config.flags import FLAG
from megalite.config.schema import ConfigError, TrainingConfig

DEFAULT_TRAIN_ITERS = 20   # without --train-iters or --train-samples
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch sizes as steps: ``steps[i] = (first consumed sample, batch)``, firsts strictly increasing from
    0; the last step's batch is the final one. ``ramp_end``: the most consumed samples at which Megatron still
    counts iterations one by one when converting --train-samples (the ramp's SAMPLES; -1 without a ramp)."""
    steps: tuple[tuple[int, int], ...]
    ramp_end: int = -1

    @property
    def ramps(self) -> bool:
        return len(self.steps) > 1

    @property
    def final(self) -> int:
        return self.steps[-1][1]

    @property
    def largest(self) -> int:
        return max(batch for _, batch in self.steps)

    @property
    def smallest(self) -> int:
        return min(batch for _, batch in self.steps)

    def sizes(self) -> list[int]:
        """Every batch size the schedule takes, in order of first use."""
        return list(dict.fromkeys(batch for _, batch in self.steps))

    def at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples``."""
        i = bisect.bisect_right([first for first, _ in self.steps], consumed_samples) - 1
        return self.steps[i][1]

    def _segments(self):
        """(first, end, batch) of each step; the last one's end is infinite."""
        ends = [first for first, _ in self.steps[1:]] + [math.inf]
        return [(first, end, batch) for (first, batch), end in zip(self.steps, ends)]

    def consumed_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        consumed, left = 0, iterations
        for first, end, batch in self._segments():
            if consumed < first or consumed >= end:
                continue
            take = left if end == math.inf else min(left, -(-(end - consumed) // batch))
            consumed, left = consumed + take * batch, left - take
            if left == 0:
                break
        return consumed

    def iterations_for(self, train_samples: int) -> int:
        """Megatron's ``update_train_iters``: iterations for ``train_samples`` samples (see the module's docstring)."""
        last = min(self.ramp_end, train_samples)
        consumed = iterations = 0
        for first, end, batch in self._segments():
            if consumed > last:
                break
            if consumed < first or consumed >= end:
                continue
            # Iterations starting in this segment while Megatron's loop condition (consumed <= last) still holds.
            take = (last - consumed) // batch + 1
            if end != math.inf:
                take = min(take, -(-(end - consumed) // batch))
            consumed, iterations = consumed + take * batch, iterations + take
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.final
        return iterations


def batch_schedule(training: TrainingConfig, seq_length: int) -> BatchSchedule:
    """The schedule of ``--rampup-batch-size`` or ``--step-batch-size-schedule``, else constant; any error in the
    option's value is a one-line ConfigError."""
    if training.rampup_batch_size is not None and training.step_batch_size_schedule is not None:
        raise ConfigError(f"{FLAG.rampup_batch_size} and {FLAG.step_batch_size_schedule} exclude each other")
    if training.rampup_batch_size is not None:
        return _rampup(training.rampup_batch_size, training.global_batch_size)
    if training.step_batch_size_schedule is not None:
        return _step_schedule(training.step_batch_size_schedule, seq_length)
    return BatchSchedule(((0, training.global_batch_size),))


def train_iterations(training: TrainingConfig, schedule: BatchSchedule) -> int:
    """Iterations of the run: --train-iters, or --train-samples' count (Megatron's rule), else 20."""
    if training.train_samples is not None:
        return schedule.iterations_for(training.train_samples)
    return DEFAULT_TRAIN_ITERS if training.train_iters is None else training.train_iters


def _rampup(text: str, final: int) -> BatchSchedule:
    words = text.split()
    try:
        start, increment, samples = (int(w) for w in words)
    except ValueError:
        raise ConfigError(f"{FLAG.rampup_batch_size} takes three integers START INCREMENT SAMPLES, got "
                          f"{text!r}") from None
    if start < 1 or increment < 1 or samples < 0:
        raise ConfigError(f"{FLAG.rampup_batch_size} {text}: need START >= 1, INCREMENT >= 1 and SAMPLES >= 0")
    if final < start or (final - start) % increment:
        raise ConfigError(f"{FLAG.rampup_batch_size} {text}: {FLAG.global_batch_size} {final} minus START {start} "
                          f"must be a non-negative multiple of INCREMENT {increment}")
    increments = (final - start) // increment
    if increments == 0 or samples == 0:   # nothing to ramp over (Megatron divides by zero at SAMPLES 0)
        return BatchSchedule(((0, final),))
    per_increment = samples / increments   # a float, as in Megatron: its steps fall where int(c / per_increment) does

    def first_with(k: int) -> int:
        """The fewest consumed samples c <= SAMPLES at which int(c / per_increment) >= k, else SAMPLES + 1."""
        low, high = 0, samples + 1
        while low < high:
            middle = (low + high) // 2
            if int(middle / per_increment) >= k:
                high = middle
            else:
                low = middle + 1
        return low

    steps = [(0, start)]
    for k in range(1, increments + 1):
        first = first_with(k)
        if first <= samples:
            steps.append((first, start + k * increment))
    if steps[-1][1] != final:
        steps.append((samples + 1, final))   # past SAMPLES the batch is the final one (Megatron: consumed > SAMPLES)
    return BatchSchedule(_merged(steps), ramp_end=samples)


def _number(text: str, what: str) -> int:
    word = text.strip().upper()
    multiplier = _SUFFIXES.get(word[-1:], 1)
    if multiplier > 1:
        word = word[:-1]
    try:
        value = float(word) * multiplier
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{FLAG.step_batch_size_schedule}: bad {what} {text!r} (a number >= 0, optionally with a "
                          f"K, M, B or T suffix)")
    return int(value)


def _step_schedule(text: str, seq_length: int) -> BatchSchedule:
    steps: list[tuple[int, int]] = []
    for entry in text.replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        if not colon:
            raise ConfigError(f"{FLAG.step_batch_size_schedule}: entry {entry!r} is not TOKENS:BATCH_SIZE")
        steps.append((_number(threshold, "threshold") // seq_length, _number(batch, "batch size")))
    if not steps:
        raise ConfigError(f"{FLAG.step_batch_size_schedule} is empty")
    steps.sort()
    if steps[0][0] != 0:
        raise ConfigError(f"{FLAG.step_batch_size_schedule} {text!r}: the first threshold must be 0")
    firsts = [first for first, _ in steps]
    if len(set(firsts)) != len(firsts):
        raise ConfigError(f"{FLAG.step_batch_size_schedule} {text!r}: thresholds must be strictly increasing (in "
                          f"samples: tokens // {FLAG.seq_length} {seq_length})")
    if any(batch < 1 for _, batch in steps):
        raise ConfigError(f"{FLAG.step_batch_size_schedule} {text!r}: batch sizes must be >= 1")
    steps = _merged(steps)
    return BatchSchedule(steps, ramp_end=steps[-1][0] - 1)


def _merged(steps: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Steps with a consecutive repeat of the same batch size dropped."""
    kept = [steps[0]]
    for first, batch in steps[1:]:
        if batch != kept[-1][1]:
            kept.append((first, batch))
    return tuple(kept)


def describe(schedule: BatchSchedule) -> str:
    """'global batch 1536' or 'global batch 16 -> 1536 (96 sizes)' for start-up lines."""
    if not schedule.ramps:
        return f"global batch {schedule.final}"
    return f"global batch {schedule.steps[0][1]} -> {schedule.final} ({len(schedule.sizes())} sizes)"
