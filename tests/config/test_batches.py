"""Batch-size schedules and training length against Megatron's own rules, written out here as Megatron computes
them (RampupBatchsizeNumMicroBatchesCalculator.update, StepBatchsizeNumMicroBatchesCalculator, update_train_iters):
one consumed-sample count at a time, where megalite works segment by segment."""

from __future__ import annotations

import pytest

from megalite.config import ConfigError, TrainingConfig
from megalite.config.batches import batch_schedule, train_iterations


def megatron_rampup(start: int, increment: int, samples: int, final: int):
    """Megatron's batch size after ``consumed`` samples."""
    per_increment = samples / ((final - start) // increment)

    def batch(consumed: int) -> int:
        if consumed > samples:
            return final
        return start + int(consumed / per_increment) * increment
    return batch


def megatron_train_iters(batch, ramp_samples: int, train_samples: int, final: int) -> int:
    """Megatron's update_train_iters for a ramp."""
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        consumed += batch(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // final
    return iterations


def _training(**options) -> TrainingConfig:
    return TrainingConfig(**{"micro_batch_size": 1, **options})


@pytest.mark.parametrize("start, increment, samples, final", [
    (16, 16, 5859375, 1536),     # the GPT-3 175B example script's ramp
    (4, 4, 40, 16), (2, 2, 7, 10), (3, 1, 1000, 9),
])
def test_rampup_matches_megatron_sample_by_sample(start, increment, samples, final):
    schedule = batch_schedule(_training(global_batch_size=final, rampup_batch_size=f"{start} {increment} {samples}"),
                              seq_length=64)
    expected = megatron_rampup(start, increment, samples, final)
    probes = sorted({*range(0, min(samples + 3, 3000)), samples, samples + 1, *range(0, samples + 2, 997)})
    assert [schedule.at(c) for c in probes] == [expected(c) for c in probes]
    assert schedule.largest == final and schedule.ramp_end == samples
    # The run's length both ways: iterations for a sample budget, samples consumed by iterations.
    for train_samples in (samples // 3, samples, samples + 5 * final + 3, 3 * samples + 11):
        assert schedule.iterations_for(train_samples) == megatron_train_iters(expected, samples, train_samples, final)
    consumed = 0
    for iterations in range(1, 400):
        consumed += expected(consumed)
        if iterations % 37 == 0 or iterations < 5:
            assert schedule.consumed_after(iterations) == consumed


def test_gpt3_175b_ramp_in_numbers():
    schedule = batch_schedule(_training(global_batch_size=1536, rampup_batch_size="16 16 5859375"), 2048)
    assert len(schedule.sizes()) == 96 and schedule.sizes()[:3] == [16, 32, 48] and schedule.at(5859376) == 1536
    assert schedule.steps[1] == (61678, 32)   # the first sample count with int(c / (5859375 / 95)) >= 1


def test_step_schedule_counts_tokens_with_suffixes():
    schedule = batch_schedule(_training(global_batch_size=3072, step_batch_size_schedule="0:768 250B:1536 500B:3072"),
                              seq_length=2048)
    assert schedule.steps == ((0, 768), (250 * 10**9 // 2048, 1536), (500 * 10**9 // 2048, 3072))
    assert (schedule.at(0), schedule.at(122070311), schedule.at(122070312)) == (768, 768, 1536)
    small = batch_schedule(_training(global_batch_size=8, step_batch_size_schedule="0:2, 1.6K:4 3.2k:8"), 100)
    assert small.steps == ((0, 2), (16, 4), (32, 8))
    # 8 iterations of 2, 4 of 4, then 8s: 16 + 16 + 8 x 4
    assert small.consumed_after(16) == 64 and small.iterations_for(64) == 16 == train_iterations(
        _training(global_batch_size=8, train_samples=64, step_batch_size_schedule="0:2 1.6K:4 3.2k:8"), small)


@pytest.mark.parametrize("options, message", [
    ({"rampup_batch_size": "16 16"}, "--rampup-batch-size takes three integers"),
    ({"rampup_batch_size": "0 16 100"}, "need START >= 1"),
    ({"rampup_batch_size": "6 4 100"}, "--global-batch-size 16 minus START 6 must be a non-negative multiple"),
    ({"step_batch_size_schedule": "100:8 200:16"}, "the first threshold must be 0"),
    ({"step_batch_size_schedule": "0:8 1x:16"}, "bad threshold '1x'"),
    ({"step_batch_size_schedule": "0:8 200"}, "entry '200' is not TOKENS:BATCH_SIZE"),
    ({"step_batch_size_schedule": "0:8 10:16"}, "thresholds must be strictly increasing (in samples"),
    ({"step_batch_size_schedule": "0:8", "rampup_batch_size": "8 8 8"}, "exclude each other"),
])
def test_bad_schedules_are_one_line_errors(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        batch_schedule(_training(global_batch_size=16, **options), seq_length=64)


def test_constant_batch_and_default_length():
    assert not batch_schedule(_training(global_batch_size=32, rampup_batch_size="8 8 0"), 64).ramps
    schedule = batch_schedule(_training(global_batch_size=8), 64)
    assert not schedule.ramps and schedule.consumed_after(5) == 40 and schedule.iterations_for(41) == 5
    assert train_iterations(_training(), schedule) == 20
    assert train_iterations(_training(train_iters=7), schedule) == 7
    assert train_iterations(_training(global_batch_size=8, train_samples=100), schedule) == 12
