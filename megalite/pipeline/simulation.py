"""A schedule's bubble at given step costs, by simulation, and the papers' formulas for it.

``simulate`` runs every rank's steps in order, each as soon as its rank is free and its input exists (an F after
the previous stage's F of the micro-batch, a B after the next stage's B, or after the last stage's own F, a W after
its B), transfers free. A schedule without W steps does the whole backward in B, which then costs B + W.

The bubble is each rank's idle time over its compute time, up to the end of the slowest rank (the optimizer step
waits for it), averaged over ranks: what ``pipeline_bubble`` in the metrics file measures. With equal step costs and
at least PP micro-batches it is (PP - 1) / (V M) for 1F1B (Narayanan et al. 2021), (PP - 1) / (3 V M) for the
zero-bubble schedules, whose drain is filled with deferred W steps, and (PP - 1) / (6 M) for ZB-V: the bubble
(PP - 1)(F + B + W) of 1F1B becomes (PP - 1)(F + B - W) (Qi et al. 2023), with F, B and W costing the same.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megalite.pipeline.partition import virtual_stage
from megalite.pipeline.schedules import Step, build_schedule, placement_of, splits_backward

UNIT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Timeline:
    busy: tuple[float, ...]      # compute time per rank
    end: tuple[float, ...]       # when each rank finishes its last step

    @property
    def makespan(self) -> float:
        return max(self.end)

    @property
    def bubble(self) -> float:
        """Idle over compute time up to the slowest rank's end, averaged over ranks."""
        return sum((self.makespan - b) / b for b in self.busy) / len(self.busy)


def run_steps(schedules: list[list[Step]], pp: int, virtual_stages: int, placement: str = "round-robin",
              costs: dict[str, float] = UNIT_COSTS) -> list[list[tuple[Step, float, float]]]:
    """When each step of every rank's ``schedules[rank]`` runs (see the module docstring): per rank, (step, start,
    end) in order; a kind without a cost costs 1. Raises ValueError if the schedules cannot finish."""
    cost = dict(costs)
    if not any(splits_backward(steps) for steps in schedules):
        cost["B"] = cost.get("B", 1.0) + cost.pop("W", 1.0)
    last = pp * virtual_stages - 1
    finished: dict[tuple[str, int, int], float] = {}
    position, free = [0] * pp, [0.0] * pp
    timed: list[list[tuple[Step, float, float]]] = [[] for _ in range(pp)]
    while any(position[r] < len(schedules[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            while position[rank] < len(schedules[rank]):
                step = schedules[rank][position[rank]]
                stage = virtual_stage(rank, step.chunk, pp, placement)
                if step.kind == "F":
                    needed = ("F", stage - 1, step.micro_batch) if stage > 0 else None
                elif step.kind == "B":
                    needed = ("B", stage + 1, step.micro_batch) if stage < last else ("F", stage, step.micro_batch)
                else:   # W, or any other kind: after the B of its micro-batch on its stage
                    needed = ("B", stage, step.micro_batch)
                if needed is not None and needed not in finished:
                    break
                start = max(free[rank], finished[needed] if needed is not None else 0.0)
                free[rank] = finished[(step.kind, stage, step.micro_batch)] = start + cost.get(step.kind, 1.0)
                timed[rank].append((step, start, free[rank]))
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the schedules cannot finish: ranks stop at steps {position}")
    return timed


def simulate(schedules: list[list[Step]], pp: int, virtual_stages: int, placement: str = "round-robin",
             costs: dict[str, float] = UNIT_COSTS) -> Timeline:
    """Time every rank's ``schedules[rank]`` (see the module docstring); raises ValueError if it cannot finish."""
    timed = run_steps(schedules, pp, virtual_stages, placement, costs)
    return Timeline(tuple(sum(end - start for _, start, end in steps) for steps in timed),
                    tuple(steps[-1][2] if steps else 0.0 for steps in timed))


# bubble_formula as text, per schedule.
BUBBLE_FORMULAS = {"1f1b": "(PP-1)/(V M)", "zero-bubble": "(PP-1)/(3 V M)", "zbv": "(PP-1)/(6 M)"}


def bubble_formula(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """The papers' bubble at equal step costs (see the module docstring); exact for M >= PP (zbv: V = 2)."""
    if pp == 1:
        return 0.0
    v, m = (2 if schedule == "zbv" else virtual_stages), num_micro_batches
    return (pp - 1) / (v * m) if schedule == "1f1b" else (pp - 1) / (3 * v * m)


@functools.lru_cache(maxsize=1024)
def schedule_bubble(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """The bubble of ``schedule`` at unit step costs: the formula where it holds (M >= PP), else simulated."""
    if num_micro_batches >= pp:
        return bubble_formula(schedule, pp, num_micro_batches, virtual_stages)
    v = 2 if schedule == "zbv" else virtual_stages
    steps = [build_schedule(pp, r, num_micro_batches, v, schedule) for r in range(pp)]
    return simulate(steps, pp, v, placement_of(schedule)).bubble
