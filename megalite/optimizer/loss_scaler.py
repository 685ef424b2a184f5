"""Loss scaling for fp16 (Micikevicius et al. 2018), with Megatron's dynamic rule.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero; gradients are
divided by it before the step. When any rank sees an inf/nan gradient, every rank skips the step together (the
overflow flag is all-reduced before anyone decides). Dynamic rule: after ``hysteresis`` overflowing steps the scale
is multiplied by ``backoff`` (never below ``min_scale``); after ``window`` clean steps in a row it is multiplied by
``growth``.

Giving up: a step that overflows at a scale that cannot go lower (``min_scale``, or a constant scale) is one the
scaler cannot fix. After ``GIVE_UP_AFTER`` (10) such steps in a row, ``gave_up`` turns True and the trainer stops with
one line, as DeepSpeed does at its minimum scale (where it stops at the first): a loss that stays NaN would otherwise
skip every step forever. Ten, not one, so that a few bad batches at the minimum scale are skipped as before; any step
that does not overflow starts the count again. The count is not saved with the scaler's state.
"""

from __future__ import annotations

from dataclasses import dataclass

GIVE_UP_AFTER = 10   # overflowing steps in a row at the lowest scale


class _GivesUp:
    """The count of overflowing steps in a row at a scale that cannot go lower."""
    overflows_at_minimum = 0

    def _count(self, found_inf: bool, at_minimum: bool) -> None:
        self.overflows_at_minimum = self.overflows_at_minimum + 1 if found_inf and at_minimum else 0

    @property
    def gave_up(self) -> bool:
        return self.overflows_at_minimum >= GIVE_UP_AFTER


@dataclass
class ConstantLossScaler(_GivesUp):
    scale: float

    def update(self, found_inf: bool) -> None:
        self._count(found_inf, at_minimum=True)

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

    def update(self, found_inf: bool) -> None:
        self._count(found_inf, at_minimum=self.scale <= self.min_scale)
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
