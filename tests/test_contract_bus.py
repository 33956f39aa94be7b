"""The bus factors every collective is priced with, by the planner, the simulators and `fourd bench comm`
(nccl-tests' PERFORMANCE.md: all-reduce 2(n−1)/n, all-gather, reduce-scatter and all-to-all (n−1)/n, broadcast
and send 1), for every operation and ring size. No torch: cosmic-ray runs it once per mutant of fourd.comm."""

from __future__ import annotations

from fractions import Fraction

import pytest

from fourd.comm import BUS_FACTOR, bus_factor


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 8, 128])
def test_bus_factors_of_every_collective(n):
    ring = Fraction(n - 1, n) if n else Fraction(0)
    want = {
        "all_reduce": 2 * ring,
        "all_gather": ring,
        "reduce_scatter": ring,
        "all_to_all": ring,
        "broadcast": Fraction(1),
        "send": Fraction(1),
    }
    assert set(BUS_FACTOR) == set(want)
    for op, factor in want.items():
        # one rank (or none) moves nothing over a link
        assert bus_factor(op, n) == (float(factor) if n > 1 else 0.0), (op, n)
