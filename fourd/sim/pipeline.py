"""Timed pipeline schedules (the lab's bench): when each action of a `fourd.schedules` list runs, given
compute times and free transfers; the step simulator's engine (fourd.sim.step) with nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from fourd.schedules import Schedule

# Backward twice forward (the usual count: two GEMMs per forward one); a split backward is half input, half weight.
UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Event:
    rank: int
    stage: int
    kind: str  # "F", "B", "I", "W"
    microbatch: int
    start: float
    end: float


def timeline(schedule: Schedule, costs: dict | list[dict] | None = None) -> list[list[Event]]:
    """Per-rank timed events in execution order, times from 0: every action starts when its rank is free and
    its inputs are there. `costs`: seconds by kind ({"F": 1, "B": 2, "I": 1, "W": 1}, UNIT, the default),
    or a list of such dicts, one per stage.

        >>> from fourd.schedules import build_schedule
        >>> ev = timeline(build_schedule("gpipe", pp=2, microbatches=2))
        >>> [(e.kind, e.microbatch, e.start, e.end) for e in ev[1]]
        [('F', 0, 1.0, 2.0), ('F', 1, 2.0, 3.0), ('B', 0, 3.0, 5.0), ('B', 1, 5.0, 7.0)]
    """
    from fourd.sim.step import simulate

    costs = UNIT if costs is None else costs
    return simulate(schedule, costs if isinstance(costs, list) else [costs] * schedule.stages).events


def idle_fractions(events: list[list[Event]]) -> tuple[float, list[float]]:
    """The step time (first start to last end over all ranks) and each rank's idle share of it."""
    t0 = min(e[0].start for e in events if e)
    t1 = max(e[-1].end for e in events if e)
    step = t1 - t0
    return step, [(step - sum(x.end - x.start for x in e)) / step for e in events]
