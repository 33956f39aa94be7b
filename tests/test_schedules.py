"""The schedule description: complete, deadlock-free, with the memory each schedule promises."""

import pytest

from fourd.errors import FourdError
from fourd.schedules import SCHEDULES, Action, Schedule, build_schedule, check_stages, validate


def _grid():
    for name in SCHEDULES:
        for p in range(1, 9):
            for m in range(1, 17):
                for v in (1, 2, 3, 4) if name == "interleaved" else (1,):
                    yield name, p, m, v


def test_every_schedule_on_the_grid_is_valid_with_exact_action_counts():
    built = 0
    for name, p, m, v in _grid():
        s = build_schedule(name, p, m, v)  # validates: raises on a missing action or a deadlock
        validate(s)
        per_rank = 3 * m if name == "zero-bubble" else 2 * v * m
        assert [len(r) for r in s.ranks] == [per_rank] * p, (name, p, m, v)
        kinds = {k: sum(a.kind == k for r in s.ranks for a in r) for k in "FBIW"}
        split = name == "zero-bubble"
        assert kinds == {
            "F": p * v * m,
            "B": 0 if split else p * v * m,
            "I": p * m if split else 0,
            "W": p * m if split else 0,
        }
        built += 1
    assert built == 896


def test_small_orders_exactly():
    s = build_schedule("1f1b", 3, 4)
    assert [" ".join(map(str, r)) for r in s.ranks] == [
        "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3",
        "F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3",
        "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3",
    ]
    z = build_schedule("zero-bubble", 3, 4)
    assert [" ".join(map(str, r)) for r in z.ranks] == [
        "F0.0 F0.1 F0.2 I0.0 W0.0 F0.3 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F1.1 I1.0 F1.2 I1.1 W1.0 F1.3 I1.2 W1.1 I1.3 W1.2 W1.3",
        "F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 W2.0 F2.3 I2.3 W2.1 W2.2 W2.3",
    ]
    i = build_schedule("interleaved", 2, 4, 2)
    assert i.stages_of_rank(1) == [1, 3] and i.stage_rank(3) == 1
    assert (
        " ".join(map(str, i.ranks[0]))
        == "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"
    )


def test_peak_in_flight():
    for p in range(1, 9):
        for m in range(1, 17):
            assert build_schedule("gpipe", p, m).peak_in_flight(0) == m
            one = build_schedule("1f1b", p, m)
            assert [one.peak_in_flight(r) for r in range(p)] == [min(p - r, m) for r in range(p)]
            zb = build_schedule("zero-bubble", p, m)
            assert max(zb.peak_in_flight(r) for r in range(p)) == min(
                p, m
            )  # 1F1B's peak (rank 0's)
    # interleaved, p = 4, V = 2, m = 8: warm-up of 4 + 2·(3 − rank) forwards, one more in steady state
    s = build_schedule("interleaved", 4, 8, 2)
    assert [s.peak_in_flight(r) for r in range(4)] == [11, 9, 7, 5]


def test_validate_catches_deadlock_missing_and_misplaced_actions():
    good = build_schedule("1f1b", 2, 2)
    # rank 0 waits at B0.0 for B1.0, which rank 1 runs only after F1.1, which needs rank 0 F0.1
    swapped = Schedule(
        "x",
        2,
        2,
        1,
        (
            (Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)),
            (Action("F", 1, 1), Action("F", 1, 0), Action("B", 1, 0), Action("B", 1, 1)),
        ),
    )
    with pytest.raises(
        FourdError, match="deadlocks: every rank waits .rank 0 at B0.0; rank 1 at F1.1"
    ):
        validate(swapped)
    with pytest.raises(FourdError, match="stage 1 microbatch 1 needs exactly one F"):
        validate(Schedule("x", 2, 2, 1, (good.ranks[0], good.ranks[1][:-1])))
    with pytest.raises(FourdError, match="F1.0 is on rank 0 but stage 1 lives on rank 1"):
        validate(Schedule("x", 2, 2, 1, (good.ranks[0] + (Action("F", 1, 0),), good.ranks[1])))
    w_first = (Action("F", 0, 0), Action("W", 0, 0), Action("I", 0, 0))
    with pytest.raises(FourdError, match="deadlocks"):
        validate(Schedule("x", 1, 1, 1, (w_first,)))


def test_impossible_combinations_name_the_fix():
    with pytest.raises(
        FourdError, match=r"^2 virtual stages need the interleaved schedule \(1f1b runs one stage"
    ):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(FourdError, match="unknown schedule 'pipedream'"):
        build_schedule("pipedream", 4, 8)
    with pytest.raises(FourdError, match="^microbatches = 0 must be a positive integer$"):
        build_schedule("gpipe", 4, 0)


def test_each_count_must_be_a_positive_integer_and_is_named():
    for args, message in [
        (("gpipe", 0, 1), "pipeline ranks = 0 must be a positive integer"),
        (("gpipe", True, 1), "pipeline ranks = True must be a positive integer"),
        (("gpipe", 2.0, 1), "pipeline ranks = 2.0 must be a positive integer"),
        (("gpipe", 2, False), "microbatches = False must be a positive integer"),
        (("gpipe", 2, -1), "microbatches = -1 must be a positive integer"),
        (("interleaved", 2, 4, 0), "virtual stages = 0 must be a positive integer"),
        (("interleaved", 2, 4, True), "virtual stages = True must be a positive integer"),
    ]:
        with pytest.raises(FourdError) as refused:
            build_schedule(*args)
        assert str(refused.value) == message, args


def test_a_schedule_name_read_from_a_file_is_compared_by_value():
    # a name built at run time (a config file's) is a different str object than the literal
    name = "".join(["inter", "leaved"])
    assert name == SCHEDULES[2] and name is not SCHEDULES[2]
    s = build_schedule(name, 2, 4, 2)
    assert (s.stages, s.actions()) == (4, 32)


def test_validate_names_each_malformed_schedule_exactly():
    good = build_schedule("1f1b", 2, 2)  # stages 0..1, microbatches 0..1
    r0, r1 = good.ranks
    f00 = Action("F", 0, 0)
    out_of_range = "is out of range (kinds F/B/I/W, stages 0..1, microbatches 0..1)"
    cases = [
        ((r0,), "schedule x: 1 rank lists for pp = 2"),
        ((r0, r1, ()), "schedule x: 3 rank lists for pp = 2"),
        ((r0 + (Action("X", 0, 0),), r1), f"schedule x: action X0.0 {out_of_range}"),
        ((r0 + (Action("F", 2, 0),), r1), f"schedule x: action F2.0 {out_of_range}"),
        ((r0, r1 + (Action("F", -1, 0),)), f"schedule x: action F-1.0 {out_of_range}"),
        ((r0 + (Action("F", 0, 2),), r1), f"schedule x: action F0.2 {out_of_range}"),
        ((r0 + (Action("F", 0, 3),), r1), f"schedule x: action F0.3 {out_of_range}"),
        ((r0 + (Action("F", 4, 0),), r1), f"schedule x: action F4.0 {out_of_range}"),
        ((r0 + (Action("F", 0, -1),), r1), f"schedule x: action F0.-1 {out_of_range}"),
        ((r0 + (f00,), r1), "schedule x: F0.0 appears twice"),
        ((r0, r1 + (f00,)), "schedule x: F0.0 is on rank 1 but stage 0 lives on rank 0"),
    ]
    for ranks, message in cases:
        with pytest.raises(FourdError) as refused:
            validate(Schedule("x", 2, 2, 1, ranks))
        assert str(refused.value) == message, ranks
    # the ranges in the line are the schedule's own: 3 stages, 3 microbatches
    three = build_schedule("gpipe", 3, 3).ranks
    with pytest.raises(FourdError) as refused:
        validate(Schedule("y", 3, 3, 1, (three[0] + (Action("F", 0, 3),), *three[1:])))
    assert str(refused.value) == (
        "schedule y: action F0.3 is out of range (kinds F/B/I/W, stages 0..2, microbatches 0..2)"
    )


def test_validate_wants_one_f_and_either_one_b_or_one_i_and_one_w():
    f, b, i, w = (Action(kind, 0, 0) for kind in "FBIW")
    need = (
        "schedule x: stage 0 microbatch 0 needs exactly one F and either one B or one I and one W"
    )
    for actions in [(b,), (f,), (f, i), (f, w), (f, b, i), (f, b, w), (f, b, i, w)]:
        with pytest.raises(FourdError) as refused:
            validate(Schedule("x", 1, 1, 1, (actions,)))
        assert str(refused.value) == need, actions
    validate(Schedule("x", 1, 1, 1, ((f, b),)))
    validate(Schedule("x", 1, 1, 1, ((f, i, w),)))
    late = Schedule("x", 1, 1, 1, ((b, f),))
    with pytest.raises(FourdError) as refused:
        validate(late)
    assert str(refused.value) == "schedule x deadlocks: every rank waits (rank 0 at B0.0)"


def test_a_built_schedule_is_immutable_and_hashable():
    s = build_schedule("1f1b", 2, 2)
    assert hash(s.ranks[0][0]) == hash(Action("F", 0, 0))
    assert {s.ranks[0][0], Action("F", 0, 0)} == {Action("F", 0, 0)}
    with pytest.raises(AttributeError):
        s.ranks[0][0].stage = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        s.pp = 3  # type: ignore[misc]
    assert hash(s) == hash(build_schedule("1f1b", 2, 2))


def test_the_stages_of_a_rank_at_any_pipeline_degree():
    # loop placement: rank r holds stages r, r + pp, r + 2·pp, ...
    s = build_schedule("interleaved", 3, 3, 3)
    assert [s.stages_of_rank(r) for r in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert [s.stage_rank(stage) for stage in range(9)] == [0, 1, 2] * 3


def test_a_pipeline_of_more_than_256_stages_is_built():
    # CPython keeps one object per small int (up to 256): stage numbers beyond it are compared by value
    s = build_schedule("1f1b", 300, 2)
    assert (s.stages, s.actions()) == (300, 1200)
    assert [str(a) for a in s.ranks[299]] == ["F299.0", "B299.0", "F299.1", "B299.1"]


def test_a_deadlock_names_only_the_ranks_left_waiting():
    # rank 0 runs a W before its I and waits there for ever; rank 1 (the last stage) finishes
    # all of its 300 actions (more than CPython's small ints), and is left out
    m = 150
    r0 = [Action("F", 0, j) for j in range(m)]
    r0 += [action for j in range(m) for action in (Action("W", 0, j), Action("I", 0, j))]
    r1 = [action for j in range(m) for action in (Action("F", 1, j), Action("B", 1, j))]
    with pytest.raises(FourdError) as refused:
        validate(Schedule("x", 2, m, 1, (tuple(r0), tuple(r1))))
    assert str(refused.value) == "schedule x deadlocks: every rank waits (rank 0 at W0.0)"


def test_check_stages_means_one_virtual_stage_unless_told():
    check_stages("1f1b", 4, 8)  # the planner's and the layout check's entry: no error
    with pytest.raises(FourdError, match="^2 virtual stages need the interleaved schedule"):
        check_stages("1f1b", 4, 8, 2)


def test_peak_in_flight_counts_sets_released_and_taken_again():
    # a valid order of one's own: the peak, 2, comes after a backward has released a set
    order = ("F0.0", "B0.0", "F0.1", "F0.2", "B0.1", "B0.2")
    actions = tuple(Action(w[0], int(w[1]), int(w[3])) for w in order)
    own = Schedule("mine", 1, 3, 1, (actions,))
    validate(own)
    assert own.peak_in_flight(0) == 2


def test_a_backward_waits_for_the_next_stages_backward_not_its_forward():
    # rank 0's B0.0 needs stage 1's input gradient, from B1.0, which rank 1 runs after F1.1,
    # which needs F0.1, which rank 0 runs after B0.0: a deadlock, though F1.0 has run
    f, b = (lambda stage, j: Action("F", stage, j)), (lambda stage, j: Action("B", stage, j))
    ranks = ((f(0, 0), b(0, 0), f(0, 1), b(0, 1)), (f(1, 0), f(1, 1), b(1, 0), b(1, 1)))
    with pytest.raises(FourdError) as refused:
        validate(Schedule("x", 2, 2, 1, ranks))
    assert str(refused.value) == (
        "schedule x deadlocks: every rank waits (rank 0 at B0.0; rank 1 at F1.1)"
    )


def test_only_the_interleaved_schedule_takes_virtual_stages():
    for name in ("gpipe", "1f1b", "zero-bubble"):
        with pytest.raises(FourdError) as refused:
            build_schedule(name, 2, 4, 2)
        assert str(refused.value) == (
            f"2 virtual stages need the interleaved schedule ({name} runs one stage per rank): "
            "choose the interleaved schedule or one virtual stage"
        )
