"""Schedule-only timelines: the bubble formulas of docs/simulators.md hold exactly."""

from fractions import Fraction

import pytest

from fourd.schedules import build_schedule
from fourd.sim.step import idle_fractions, timeline

# Integer durations keep the arithmetic exact: equal means equal.
UNIT = {"F": 1, "B": 2, "I": 1, "W": 1}


def idle_times(events):
    """The step time and each rank's idle time, exactly."""
    step = max(e[-1].end for e in events) - min(e[0].start for e in events)
    return step, [step - sum(x.end - x.start for x in e) for e in events]


@pytest.mark.slow  # seconds of exact schedules up to 16 ranks
def test_gpipe_and_1f1b_idle_fraction_is_p_minus_1_over_m_plus_p_minus_1_on_every_rank():
    for name in ("gpipe", "1f1b"):
        for p in range(1, 17):
            for m in [
                *range(1, 17),
                31,
                32,
                63,
                64,
            ]:  # every m ≤ 64 runs through the step simulator's test
                step, idle = idle_times(timeline(build_schedule(name, p, m), UNIT))
                assert step == 3 * (m + p - 1)
                assert [Fraction(i, step) for i in idle] == [Fraction(p - 1, m + p - 1)] * p, (
                    name,
                    p,
                    m,
                )


def test_gpipe_bubble_on_16_ranks():
    for m, want in ((16, 0.484), (64, 0.190), (128, 0.105)):
        _, idle = idle_fractions(timeline(build_schedule("gpipe", 16, m)))
        assert round(idle[0], 3) == want


@pytest.mark.slow  # seconds of exact schedules up to 16 ranks
def test_interleaved_bubble_over_compute_is_p_minus_1_over_v_m():
    for p in range(1, 17):
        for v in (2, 3):
            for m in range(p, 65, p):
                # a rank's layers cut into V equal stages: compute per rank 3·V·m units
                step, idle = idle_times(timeline(build_schedule("interleaved", p, m, v), UNIT))
                assert [Fraction(i, 3 * v * m) for i in idle] == [Fraction(p - 1, v * m)] * p, (
                    p,
                    v,
                    m,
                )


def test_interleaved_m_not_a_multiple_of_p_keeps_the_bubble():
    for p, m, v in ((4, 6, 2), (4, 9, 2), (16, 24, 2), (16, 20, 4)):
        step, idle = idle_times(timeline(build_schedule("interleaved", p, m, v), UNIT))
        assert [Fraction(i, 3 * v * m) for i in idle] == [Fraction(p - 1, v * m)] * p


@pytest.mark.slow  # seconds of exact schedules up to 16 ranks
def test_zero_bubble_h1_idles_a_third_of_1f1b():
    for p in range(1, 17):
        for m in range(p, 65, 3):
            step, idle = idle_times(timeline(build_schedule("zero-bubble", p, m), UNIT))
            assert step == 3 * m + (p - 1)
            assert idle == [p - 1] * p  # (p−1)(T_F + T_I − T_W), Qi et al. 2023


def test_events_are_the_lab_view():
    ev = timeline(build_schedule("1f1b", 2, 2))
    assert [(e.rank, e.stage, e.kind, e.microbatch, e.start, e.end) for e in ev[0]] == [
        (0, 0, "F", 0, 0.0, 1.0),
        (0, 0, "F", 1, 1.0, 2.0),
        (0, 0, "B", 0, 4.0, 6.0),
        (0, 0, "B", 1, 7.0, 9.0),
    ]


def test_gpipe_with_unequal_stages_is_a_flow_shop():
    # identical microbatches through stages of unequal cost: makespan Σ t_s + (m − 1)·max t_s, forward then backward
    for p, m in ((3, 5), (4, 7), (5, 2)):
        costs = [{"F": 3 + s % 3, "B": 5 + (s * 7) % 4} for s in range(p)]
        ev = timeline(build_schedule("gpipe", p, m), costs)
        f, b = [c["F"] for c in costs], [c["B"] for c in costs]
        assert max(e[-1].end for e in ev) == sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)
