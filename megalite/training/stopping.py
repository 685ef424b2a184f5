"""Stopping a run on purpose: a scheduler's SIGTERM, an iteration budget, a time budget; and refusing to go on
after a NaN, or (fp16) after skipped steps that no loss scale can fix (overflowing at the lowest scale, or a loss
that is itself NaN/inf).

Every rank must take the same decision at the same iteration, or the ones that stop leave the others waiting in a
collective: a SIGTERM may reach only some ranks, and clocks differ. So each rank contributes its own wish and one
all-reduce (MAX) over the world decides for all, once per iteration, and only when one of these options is on.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from megalite.config import TrainingConfig
from megalite.optimizer.loss_scaler import GIVE_UP_AFTER


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN/Inf); reported as one line, exit code 1."""


class StopRequests:
    def __init__(self, cfg: TrainingConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.started = time.monotonic()
        self.signalled = False
        if cfg.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = True   # acted on at the end of the current iteration, together with the other ranks

    @property
    def active(self) -> bool:
        c = self.cfg
        return c.exit_signal_handler or c.exit_interval is not None or c.exit_duration_in_mins is not None

    def reason_to_stop(self, iteration: int) -> Optional[str]:
        """Why every rank stops after ``iteration``, or None to go on (a collective when any option is on)."""
        if not self.active:
            return None
        c = self.cfg
        elapsed_min = (time.monotonic() - self.started) / 60
        wishes = torch.tensor([float(self.signalled),
                               float(c.exit_interval is not None and iteration % c.exit_interval == 0),
                               float(c.exit_duration_in_mins is not None and elapsed_min >= c.exit_duration_in_mins)],
                              device=self.device)
        if dist.is_initialized():
            dist.all_reduce(wishes, op=dist.ReduceOp.MAX)
        for wish, reason in zip(wishes.tolist(), ["SIGTERM received", f"--exit-interval {c.exit_interval}",
                                                   f"--exit-duration-in-mins {c.exit_duration_in_mins}"]):
            if wish:
                return reason
        return None


def check_finite(iteration: int, loss: float, grad_norm: Optional[float], local_bad: bool,
                 device: torch.device) -> None:
    """Raise TrainingError naming the ranks whose loss or gradients were not finite (a collective, taken only
    when the global loss or norm, equal on every rank, says something is wrong)."""
    import math
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
        return
    flags = [torch.zeros(1, device=device) for _ in range(dist.get_world_size() if dist.is_initialized() else 1)]
    mine = torch.tensor([float(local_bad)], device=device)
    if dist.is_initialized():
        dist.all_gather(flags, mine)
    else:
        flags = [mine]
    ranks = [r for r, f in enumerate(flags) if f.item() > 0]
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    raise TrainingError(f"iteration {iteration}: {what} is {loss if what == 'loss' else grad_norm} "
                        f"(non-finite loss or gradients on rank(s) {ranks or 'unknown'}); stopping "
                        f"(--no-check-for-nan-in-loss-and-grad to go on)")


def check_loss_scale(iteration: int, scaler) -> None:
    """Raise TrainingError once the fp16 loss scaler gave up (see megalite.optimizer.loss_scaler): every rank
    decides alike, the overflow flag and the loss's finiteness being agreed over all ranks before the scaler counts
    them."""
    if not scaler.gave_up:
        return
    if scaler.overflows_at_minimum >= GIVE_UP_AFTER:
        where = "--loss-scale" if not hasattr(scaler, "min_scale") else "--min-loss-scale"
        raise TrainingError(f"iteration {iteration}: {scaler.overflows_at_minimum} steps in a row overflowed (inf/nan "
                            f"gradients) at the lowest loss scale {scaler.scale:g} ({where}); stopping: fp16 cannot go "
                            f"on from here (try --bf16 or a lower --lr)")
    raise TrainingError(f"iteration {iteration}: the loss was not finite (NaN/inf) in {scaler.nonfinite_losses} "
                        f"steps in a row, each skipped by --fp16; stopping: a loss scale cannot fix that (it scales "
                        f"the loss after the forward pass), the weights or the data are broken (try --bf16 or a lower "
                        f"--lr)")
