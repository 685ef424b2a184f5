"""fp16 loss scaling gives up: overflowing steps in a row at a scale that cannot go lower (the minimum of the dynamic
rule, or a constant scale) stop training with one line after GIVE_UP_AFTER of them; any clean step starts the count
again, and overflows above the minimum only lower the scale."""

from __future__ import annotations

import re

import pretrain_gpt
from megalite.optimizer import ConstantLossScaler, DynamicLossScaler
from megalite.optimizer.loss_scaler import GIVE_UP_AFTER


def test_overflows_in_a_row_at_the_minimum_give_up():
    scaler = DynamicLossScaler(scale=4.0, min_scale=1.0, hysteresis=1)
    scaler.update(True)
    scaler.update(True)          # 4 -> 2 -> 1: lowering the scale is the cure, not a reason to stop
    assert scaler.scale == 1.0 and scaler.overflows_at_minimum == 0
    for _ in range(GIVE_UP_AFTER - 1):
        scaler.update(True)
    assert not scaler.gave_up
    scaler.update(False)         # a clean step starts the count again
    for _ in range(GIVE_UP_AFTER):
        assert not scaler.gave_up
        scaler.update(True)
    assert scaler.gave_up and scaler.scale == 1.0
    assert set(scaler.state_dict()) == {"scale", "clean_steps", "hysteresis_left"}   # checkpoints as before


def test_a_constant_scale_gives_up_too():
    scaler = ConstantLossScaler(8.0)
    for _ in range(GIVE_UP_AFTER):
        assert not scaler.gave_up
        scaler.update(True)
    assert scaler.gave_up


def test_overflows_with_a_non_finite_loss_give_up_above_the_minimum():
    """No scale fixes a NaN/inf loss (it is computed before scaling): ten such steps in a row give up, however high
    the scale still is; an overflow with a finite loss, or a clean step, starts the count again."""
    scaler = DynamicLossScaler(scale=2.0**32, min_scale=1.0)
    for _ in range(GIVE_UP_AFTER - 1):
        scaler.update(True, loss_finite=False)
    scaler.update(True)              # the gradients overflowed, the loss did not: lowering the scale may fix it
    for _ in range(GIVE_UP_AFTER - 1):
        scaler.update(True, loss_finite=False)
    assert not scaler.gave_up
    scaler.update(True, loss_finite=False)
    assert scaler.gave_up and scaler.nonfinite_losses == GIVE_UP_AFTER and scaler.scale > 1.0


def test_fp16_training_whose_loss_stays_nan_stops_with_one_line(capsys):
    argv = ["model=gpt_tiny", "data=mock", "--eval-interval", "0", "--train-iters", "40", "--global-batch-size", "2",
            "--fp16", "--lr", "1e30", "--clip-grad", "0", "--initial-loss-scale", "1", "--min-loss-scale", "1"]
    assert pretrain_gpt.main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"megalite: error: iteration \d+: {GIVE_UP_AFTER} steps in a row overflowed \(inf/nan gradients\) at the "
        rf"lowest loss scale 1 \(--min-loss-scale\); stopping: fp16 cannot go on from here \(try --bf16 or a lower "
        rf"--lr\)", lines[0]), lines
