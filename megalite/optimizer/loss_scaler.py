"""Loss scaling for fp16 (Micikevicius et al. 2018), with Megatron's dynamic rule.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero; gradients are
divided by it before the step. When any rank sees an inf/nan gradient, every rank skips the step together (the
overflow flag is all-reduced before anyone decides). Dynamic rule: after ``hysteresis`` overflowing steps the scale
is multiplied by ``backoff`` (never below ``min_scale``); after ``window`` clean steps in a row it is multiplied by
``growth``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ConstantLossScaler:
    scale: float

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]


@dataclass
class DynamicLossScaler:
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
