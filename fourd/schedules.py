"""Pipeline schedules as plain data, written once: for each pipeline rank, its compute actions in
execution order. The trainer runs these lists, the simulator times them, the lab draws them
(docs/simulators.md).

Stage s of pp·V (model order) lives on rank s % pp (Narayanan et al. 2021). Actions: "F" forward,
"B" full backward, or "I" (input gradient, which the previous stage waits for) and "W" (weight
gradients, which fill bubbles; Qi et al. 2023, zero bubble).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from fourd.errors import FourdError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B", "I" or "W"
    stage: int  # global stage index 0 .. pp·V−1 in model order
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    ranks: tuple[
        tuple[Action, ...], ...
    ]  # per pipeline rank, its compute actions in execution order

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def stage_rank(self, stage: int) -> int:
        """The rank that runs `stage` (loop placement)."""
        return stage % self.pp

    def stages_of_rank(self, rank: int) -> list[int]:
        return [rank + k * self.pp for k in range(self.virtual_stages)]

    def peak_in_flight(self, rank: int) -> int:
        """Most (stage, microbatch) activation sets the rank holds at once, each from its F until
        its B or W; with V > 1 a set is one virtual stage, 1/V of the rank's layers."""
        held = peak = 0
        for a in self.ranks[rank]:
            if a.kind == "F":
                held += 1
                peak = max(peak, held)
            elif a.kind in ("B", "W"):
                held -= 1
        return peak

    def actions(self) -> int:
        return sum(len(r) for r in self.ranks)


def check_stages(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """FourdError unless schedule `name` can run pp ranks, this many microbatches and virtual
    stages."""
    for what, value in (
        ("pipeline ranks", pp),
        ("microbatches", microbatches),
        ("virtual stages", virtual_stages),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FourdError(f"{what} = {value!r} must be a positive integer")
    if name not in SCHEDULES:
        raise FourdError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if name != "interleaved" and virtual_stages != 1:
        raise FourdError(
            f"{virtual_stages} virtual stages need the interleaved schedule ({name} runs one stage "
            "per rank): choose the interleaved schedule or one virtual stage"
        )


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The per-rank action lists of schedule `name`; FourdError for impossible combinations."""
    check_stages(name, pp, microbatches, virtual_stages)
    build = {
        "gpipe": _gpipe,
        "1f1b": _one_f_one_b,
        "interleaved": _interleaved,
        "zero-bubble": _zb_h1,
    }[name]
    ranks = tuple(tuple(build(r, pp, microbatches, virtual_stages)) for r in range(pp))
    schedule = Schedule(name, pp, microbatches, virtual_stages, ranks)
    validate(schedule)
    return schedule


def _gpipe(rank, pp, m, v):
    """All forwards, then all backwards (Huang et al. 2019)."""
    return [Action("F", rank, j) for j in range(m)] + [Action("B", rank, j) for j in range(m)]


def _one_f_one_b(rank, pp, m, v):
    """PipeDream-Flush (Narayanan et al. 2021): pp−1−rank warm-up forwards, then one F one B;
    pp−rank in flight."""
    return _warm_steady_cool(
        [Action("F", rank, j) for j in range(m)],
        [Action("B", rank, j) for j in range(m)],
        min(pp - 1 - rank, m),
    )


def _warm_steady_cool(forwards, backwards, warmup):
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    return order + backwards[len(forwards) - warmup :]


def _rounds(pp: int, m: int) -> list[range]:
    """Microbatches in rounds of at least pp (one when m < pp), as even as possible: a rank cycles
    through its V stages once per round. Uneven rounds let m be any count, as Llama 3 needed
    (§3.3.2)."""
    n = max(1, m // pp)
    sizes = [m // n + (1 if i < m % n else 0) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [range(s, s + k) for s, k in zip(starts, sizes)]


def _interleaved(rank, pp, m, v):
    """Interleaved 1F1B (Narayanan et al. 2021): per round, forwards through the rank's stages in
    model order, backwards in reverse, after a warm-up that lets the last virtual stage's first
    backward arrive."""
    rounds = _rounds(pp, m)
    forwards = [Action("F", rank + k * pp, j) for r in rounds for k in range(v) for j in r]
    backwards = [
        Action("B", rank + k * pp, j) for r in rounds for k in reversed(range(v)) for j in r
    ]
    warmup = min((v - 1) * len(rounds[0]) + 2 * (pp - 1 - rank), len(forwards))
    return _warm_steady_cool(forwards, backwards, warmup)


def _zb_h1(rank, pp, m, v):
    """ZB-H1 (Qi et al. 2023): 1F1B's order with each backward split into I and W, rank r's W held
    back r microbatches behind its I, so that the deferred W fill the tail where 1F1B idles."""
    order = []
    for a in _warm_steady_cool(
        [Action("F", rank, j) for j in range(m)],
        [Action("I", rank, j) for j in range(m)],
        min(pp - 1 - rank, m),
    ):
        order.append(a)
        if a.kind == "I" and a.microbatch >= rank:
            order.append(Action("W", rank, a.microbatch - rank))
    deferred = sum(a.kind == "W" for a in order)
    return order + [Action("W", rank, j) for j in range(deferred, m)]


def validate(schedule: Schedule) -> None:
    """FourdError unless every (stage, microbatch) has one F and one B (or one I and one W) on the
    stage's rank, and the lists, run in order with the dependencies of `depends_on`, all
    complete."""
    p, m, n = schedule.pp, schedule.microbatches, schedule.stages
    if len(schedule.ranks) != p:
        raise FourdError(f"schedule {schedule.name}: {len(schedule.ranks)} rank lists for pp = {p}")
    seen: dict[tuple[str, int, int], int] = {}
    for r, actions in enumerate(schedule.ranks):
        for a in actions:
            if a.kind not in KINDS or not (0 <= a.stage < n) or not (0 <= a.microbatch < m):
                raise FourdError(
                    f"schedule {schedule.name}: action {a} is out of range "
                    f"(kinds {'/'.join(KINDS)}, stages 0..{n - 1}, microbatches 0..{m - 1})"
                )
            if schedule.stage_rank(a.stage) != r:
                raise FourdError(
                    f"schedule {schedule.name}: {a} is on rank {r} but stage {a.stage} "
                    f"lives on rank {schedule.stage_rank(a.stage)}"
                )
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise FourdError(f"schedule {schedule.name}: {a} appears twice")
            seen[key] = r
    for s, j in itertools.product(range(n), range(m)):
        full, split = ("B", s, j) in seen, (("I", s, j) in seen, ("W", s, j) in seen)
        if ("F", s, j) not in seen or full == any(split) or split[0] != split[1]:
            raise FourdError(
                f"schedule {schedule.name}: stage {s} microbatch {j} needs exactly one F and "
                "either one B or one I and one W"
            )
    stuck = _first_deadlock(schedule)
    if stuck:
        raise FourdError(f"schedule {schedule.name} deadlocks: every rank waits ({stuck})")


def depends_on(a: Action, stages: int) -> list[tuple[str, int, int]]:
    """The actions `a` waits for, as (kind, stage, microbatch); "grad" is the next stage's B or
    I."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
    if a.kind == "W":
        return [("I", a.stage, a.microbatch)]
    deps = [("F", a.stage, a.microbatch)]
    if a.stage < stages - 1:
        deps.append(("grad", a.stage + 1, a.microbatch))
    return deps


def _keys(a: Action) -> list[tuple[str, int, int]]:
    """What finishing `a` satisfies: itself, and for B or I the stage's input gradient ("grad")."""
    keys = [(a.kind, a.stage, a.microbatch)]
    if a.kind in ("B", "I"):
        keys.append(("grad", a.stage, a.microbatch))
    return keys


def _first_deadlock(schedule: Schedule) -> str:
    """Execute the lists in order with dependencies only; '' when all complete, else the blocked
    heads."""
    done: set[tuple[str, int, int]] = set()
    pos = [0] * schedule.pp
    total = schedule.actions()
    finished = 0
    progress = True
    while finished < total and progress:
        progress = False
        for r, actions in enumerate(schedule.ranks):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                if not all(d in done for d in depends_on(a, schedule.stages)):
                    break
                done.update(_keys(a))
                pos[r] += 1
                finished += 1
                progress = True
    if finished == total:
        return ""
    return "; ".join(
        f"rank {r} at {acts[pos[r]]}" for r, acts in enumerate(schedule.ranks) if pos[r] < len(acts)
    )
