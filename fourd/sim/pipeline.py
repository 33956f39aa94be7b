"""Timed pipeline schedules: when each action of a `fourd.schedules` list runs, given durations.

This is the schedule-only view (the lab's bench): every rank runs its list in order,
each action as soon as its rank is free and its inputs have arrived. `fourd sim step` adds
communication and link contention on top (fourd.sim.step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fourd.schedules import Action, Schedule, depends_on

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


def timeline(
    schedule: Schedule,
    duration: Callable[[Action], float] | dict | None = None,
    delay: Callable[[Action, Action], float] | None = None,
) -> list[list[Event]]:
    """Per-rank lists of timed events (rank, stage, kind, microbatch, start, end), in execution order.

    `duration` gives an action's compute time: a dict by kind ({"F": 1, "B": 2, "I": 1, "W": 1},
    the default: unit forward, backward twice forward), or a function of the Action (e.g. a cost
    model's per-stage times). `delay(dep, action)` is the time for dep's output to reach action's
    rank (default 0: free transfers). Every action starts when its rank has finished the previous
    one and all it depends on has arrived; times start at 0.

        >>> from fourd.schedules import build_schedule
        >>> ev = timeline(build_schedule("gpipe", pp=2, microbatches=2))
        >>> [(e.kind, e.microbatch, e.start, e.end) for e in ev[1]]
        [('F', 0, 1.0, 2.0), ('F', 1, 2.0, 3.0), ('B', 0, 3.0, 5.0), ('B', 1, 5.0, 7.0)]
    """
    table = UNIT if duration is None else duration
    dur: Any = (lambda a: table[a.kind]) if isinstance(table, dict) else duration
    finish: dict[tuple[str, int, int], tuple[float, Action]] = {}
    events: list[list[Event]] = [[] for _ in range(schedule.pp)]
    pos = [0] * schedule.pp
    free: list[Any] = [0] * schedule.pp
    remaining = schedule.actions()
    while remaining:
        moved = False
        for r, actions in enumerate(schedule.ranks):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                deps: list[Any] = [finish.get(d) for d in depends_on(a, schedule.stages)]
                if None in deps:
                    break
                start = free[r]
                for t, d in deps:
                    start = max(start, t + (delay(d, a) if delay else 0))
                end = start + dur(a)
                events[r].append(Event(r, a.stage, a.kind, a.microbatch, start, end))
                finish[(a.kind, a.stage, a.microbatch)] = (end, a)
                if a.kind in ("B", "I"):
                    finish[("grad", a.stage, a.microbatch)] = (end, a)
                free[r] = end
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise RuntimeError("schedule deadlocks; fourd.schedules.validate says where")
    return events


def idle_fractions(events: list[list[Event]]) -> tuple[float, list[float]]:
    """The step time (first start to last end over all ranks) and each rank's idle share of it."""
    t0 = min(e[0].start for e in events if e)
    t1 = max(e[-1].end for e in events if e)
    step = t1 - t0
    return step, [(step - sum(x.end - x.start for x in e)) / step for e in events]
