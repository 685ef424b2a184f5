"""Loss scaling for fp16 (Micikevicius et al. 2018), with Megatron's dynamic rule.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero; gradients are
divided by it before the step. When any rank sees an inf/nan gradient, every rank skips the step together (the
overflow flag is all-reduced before anyone decides). Dynamic rule: after ``hysteresis`` overflowing steps the scale
is multiplied by ``backoff`` (never below ``min_scale``); after ``window`` clean steps in a row it is multiplied by
``growth``.

Giving up: a step that overflows at a scale that cannot go lower (``min_scale``, or a constant scale) is one the
scaler cannot fix; neither is a step whose loss itself is not finite (the scale multiplies the loss after the forward
pass, so no scale makes a NaN/inf loss finite: the weights or the data are broken, not the gradients' range). After
``GIVE_UP_AFTER`` (10) such steps in a row, of either kind, ``gave_up`` turns True and the trainer stops with one line,
as DeepSpeed does at its minimum scale (where it stops at the first): a loss that stays NaN would otherwise skip every
step forever. Ten, not one, so that a few bad batches are skipped as before; any step that does not overflow starts
the counts again. So at most hysteresis - 1 + log2(initial / min scale) + 10 steps in a row are skipped while the loss
is finite (43 with the defaults), and 10 once it is not. The counts are not saved with the scaler's state.
"""

from __future__ import annotations

from dataclasses import dataclass

GIVE_UP_AFTER = 10   # overflowing steps in a row at the lowest scale


class _GivesUp:
    """The counts of overflowing steps in a row that no scale can fix: at a scale that cannot go lower, and with a
    loss that is not finite."""
    overflows_at_minimum = 0
    nonfinite_losses = 0

    def _count(self, found_inf: bool, at_minimum: bool, loss_finite: bool) -> None:
        self.overflows_at_minimum = self.overflows_at_minimum + 1 if found_inf and at_minimum else 0
        self.nonfinite_losses = self.nonfinite_losses + 1 if found_inf and not loss_finite else 0

    @property
    def gave_up(self) -> bool:
        return max(self.overflows_at_minimum, self.nonfinite_losses) >= GIVE_UP_AFTER


@dataclass
class ConstantLossScaler(_GivesUp):
    scale: float

    def update(self, found_inf: bool, loss_finite: bool = True) -> None:
        self._count(found_inf, at_minimum=True, loss_finite=loss_finite)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]


@dataclass
class DynamicLossScaler(_GivesUp):
    scale: float
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    growth: float = 2.0
    backoff: float = 0.5

    def __post_init__(self):
        self._clean_steps = 0
        self._hysteresis_left = self.hysteresis

    def update(self, found_inf: bool, loss_finite: bool = True) -> None:
        """One step's outcome: ``found_inf`` on any rank, ``loss_finite`` the loss on every rank (see _GivesUp)."""
        self._count(found_inf, at_minimum=self.scale <= self.min_scale, loss_finite=loss_finite)
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps == self.window:
                self._clean_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        self._hysteresis_left = state["hysteresis_left"]
