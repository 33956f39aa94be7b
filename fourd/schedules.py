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
    # per pipeline rank, its compute actions in execution order
    ranks: tuple[tuple[Action, ...], ...]

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
        for action in self.ranks[rank]:
            if action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif action.kind in ("B", "W"):
                held -= 1
        return peak

    def actions(self) -> int:
        return sum(len(rank_actions) for rank_actions in self.ranks)


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
    ranks = tuple(tuple(build(rank, pp, microbatches, virtual_stages)) for rank in range(pp))
    schedule = Schedule(
        name=name, pp=pp, microbatches=microbatches, virtual_stages=virtual_stages, ranks=ranks
    )
    validate(schedule)
    return schedule


def _gpipe(rank, pp_ranks, microbatches, virtual):
    """All forwards, then all backwards (Huang et al. 2019)."""
    return [Action("F", rank, j) for j in range(microbatches)] + [
        Action("B", rank, j) for j in range(microbatches)
    ]


def _one_f_one_b(rank, pp_ranks, microbatches, virtual):
    """PipeDream-Flush (Narayanan et al. 2021): pp−1−rank warm-up forwards, then one F one B;
    pp−rank in flight."""
    return _warm_steady_cool(
        [Action("F", rank, j) for j in range(microbatches)],
        [Action("B", rank, j) for j in range(microbatches)],
        min(pp_ranks - 1 - rank, microbatches),
    )


def _warm_steady_cool(forwards, backwards, warmup):
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup :]


def _rounds(pp_ranks: int, microbatches: int) -> list[range]:
    """Microbatches in rounds of at least pp (one when m < pp), as even as possible: a rank cycles
    through its V stages once per round. Uneven rounds let m be any count, as Llama 3 needed
    (§3.3.2)."""
    count = max(1, microbatches // pp_ranks)
    sizes = [microbatches // count + (1 if i < microbatches % count else 0) for i in range(count)]
    starts = [sum(sizes[:i]) for i in range(count)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _interleaved(rank, pp_ranks, microbatches, virtual):
    """Interleaved 1F1B (Narayanan et al. 2021): per round, forwards through the rank's stages in
    model order, backwards in reverse, after a warm-up that lets the last virtual stage's first
    backward arrive."""
    rounds = _rounds(pp_ranks, microbatches)
    forwards = [
        Action("F", rank + k * pp_ranks, j)
        for group in rounds
        for k in range(virtual)
        for j in group
    ]
    backwards = [
        Action("B", rank + k * pp_ranks, j)
        for group in rounds
        for k in reversed(range(virtual))
        for j in group
    ]
    warmup = min((virtual - 1) * len(rounds[0]) + 2 * (pp_ranks - 1 - rank), len(forwards))
    return _warm_steady_cool(forwards, backwards, warmup)


def _zb_h1(rank, pp_ranks, microbatches, virtual):
    """ZB-H1 (Qi et al. 2023): 1F1B's order with each backward split into I and W, rank r's W held
    back r microbatches behind its I, so that the deferred W fill the tail where 1F1B idles."""
    order = []
    for action in _warm_steady_cool(
        [Action("F", rank, j) for j in range(microbatches)],
        [Action("I", rank, j) for j in range(microbatches)],
        min(pp_ranks - 1 - rank, microbatches),
    ):
        order.append(action)
        if action.kind == "I" and action.microbatch >= rank:
            order.append(Action("W", rank, action.microbatch - rank))
    deferred = len([action for action in order if action.kind == "W"])
    return order + [Action("W", rank, j) for j in range(deferred, microbatches)]


def validate(schedule: Schedule) -> None:
    """FourdError unless every (stage, microbatch) has one F and one B (or one I and one W) on the
    stage's rank, and the lists, run in order with the dependencies of `depends_on`, all
    complete."""
    ranks = schedule.pp
    microbatches = schedule.microbatches
    stages = schedule.stages
    if len(schedule.ranks) != ranks:
        raise FourdError(
            f"schedule {schedule.name}: {len(schedule.ranks)} rank lists for pp = {ranks}"
        )
    seen: dict[tuple[str, int, int], int] = {}
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if (
                action.kind not in KINDS
                or not (0 <= action.stage < stages)
                or not (0 <= action.microbatch < microbatches)
            ):
                raise FourdError(
                    f"schedule {schedule.name}: action {action} is out of range "
                    f"(kinds {'/'.join(KINDS)}, stages 0..{stages - 1}, microbatches "
                    f"0..{microbatches - 1})"
                )
            if schedule.stage_rank(action.stage) != rank:
                raise FourdError(
                    f"schedule {schedule.name}: {action} is on rank {rank} but stage "
                    f"{action.stage} lives on rank {schedule.stage_rank(action.stage)}"
                )
            key = (action.kind, action.stage, action.microbatch)
            if key in seen:
                raise FourdError(f"schedule {schedule.name}: {action} appears twice")
            seen[key] = rank
    for stage, j in itertools.product(range(stages), range(microbatches)):
        full, split = ("B", stage, j) in seen, (("I", stage, j) in seen, ("W", stage, j) in seen)
        if ("F", stage, j) not in seen or full == any(split) or split[0] != split[1]:
            raise FourdError(
                f"schedule {schedule.name}: stage {stage} microbatch {j} needs exactly one F and "
                "either one B or one I and one W"
            )
    stuck = _first_deadlock(schedule)
    if stuck:
        raise FourdError(f"schedule {schedule.name} deadlocks: every rank waits ({stuck})")


def depends_on(action: Action, stages: int) -> list[tuple[str, int, int]]:
    """The actions `a` waits for, as (kind, stage, microbatch); "grad" is the next stage's B or
    I."""
    if action.kind == "F":
        return [("F", action.stage - 1, action.microbatch)] if action.stage > 0 else []
    if action.kind == "W":
        return [("I", action.stage, action.microbatch)]
    deps = [("F", action.stage, action.microbatch)]
    if action.stage < stages - 1:
        deps.append(("grad", action.stage + 1, action.microbatch))
    return deps


def _keys(action: Action) -> list[tuple[str, int, int]]:
    """What finishing `a` satisfies: itself, and for B or I the stage's input gradient ("grad")."""
    keys = [(action.kind, action.stage, action.microbatch)]
    if action.kind in ("B", "I"):
        keys.append(("grad", action.stage, action.microbatch))
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
        for rank, actions in enumerate(schedule.ranks):
            while pos[rank] < len(actions):
                action = actions[pos[rank]]
                if not all(
                    dependency in done for dependency in depends_on(action, schedule.stages)
                ):
                    break
                done.update(_keys(action))
                pos[rank] += 1
                finished += 1
                progress = True
    if finished == total:
        return ""
    return "; ".join(
        f"rank {rank} at {acts[pos[rank]]}"
        for rank, acts in enumerate(schedule.ranks)
        if pos[rank] < len(acts)
    )
