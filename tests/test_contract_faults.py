"""The failure simulator's promises at their exact edges and on runs small enough to work out by
hand, in one process (fast):

- the rates and defaults: 47 planned interruptions in 54 days, a 10 s save, a 5 min restart, Daly's
  interval unless told, Daly's τ = M once δ reaches 2M;
- each input refused at its edge with the same line, a run too large for half the free memory too;
- two runs of four interruption slots through `_spans`, every gap's useful, lost, restart and
  checkpoint seconds computed by hand (docs/simulators.md's rules);
- enough slots that no run runs out: the count of interruptions keeps its Poisson spread, and
  its rate where they come less than two seconds apart (10⁸ GPUs);
- `summary` of a result written by hand, every key; the figures docs/simulators.md quotes for
  seed 0.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from fourd.errors import FourdError
from fourd.sim import faults

DAY = 86_400.0


def test_planned_rate_save_and_restart_defaults():
    assert faults.planned_per_day() == 47 / 54
    r = faults.simulate(16, 1, runs=2)
    assert (r.checkpoint_s, r.restart_s) == (10.0, 300.0)
    assert r.interval_s == faults.daly_interval(10.0, faults.mtbf_s(16))
    assert faults.simulate(16, 1, runs=2, interval_s=600.0).interval_s == 600.0


def test_daly_checkpoints_once_per_mtbf_from_a_save_of_twice_the_mtbf():
    """δ = 2M is the first save that long; just below, the series: √(2δM)(1 + ⅓√x + x/9) − δ at
    x = δ / 2M."""
    assert faults.daly_interval(200, 100) == 100
    x = 199 / 200
    assert faults.daly_interval(199, 100) == pytest.approx(
        (2 * 199 * 100) ** 0.5 * (1 + x**0.5 / 3 + x / 9) - 199, rel=1e-12
    )


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((0, 1), {}),
        ((-16, 1), {}),
        ((16, 0), {}),
        ((16, 1), {"runs": 0}),
        ((16, 1), {"interval_s": 0.0}),
        ((16, 1), {"checkpoint_s": -1e-9}),
        ((16, 1), {"restart_s": -1e-9}),
        ((16, 1), {"checkpoint_s": float("inf")}),
        ((16, 1), {"restart_s": float("inf")}),
        ((16, 1), {"interval_s": float("nan")}),
        ((16, float("inf")), {"checkpoint_s": 0.0}),
        ((16, 1), {"checkpoint_s": float("inf"), "restart_s": 0.0}),
    ],
)
def test_each_input_is_refused_at_its_edge_with_every_value_named(args, kwargs):
    full = {"runs": 1000, "interval_s": None, "checkpoint_s": 10.0, "restart_s": 300.0, **kwargs}
    with pytest.raises(FourdError) as refused:
        faults.simulate(*args, **kwargs)
    assert str(refused.value) == (
        f"{args[0]} GPUs, {args[1]} days, {full['runs']} runs, checkpoint interval "
        f"{full['interval_s']} s, checkpoint {full['checkpoint_s']} s, restart {full['restart_s']} "
        "s: each must be finite, and positive (the last two may be 0)"
    )


def test_the_smallest_accepted_inputs():
    r = faults.simulate(1, 1e-6, runs=1, interval_s=1e-3, checkpoint_s=0.0, restart_s=0.0)
    assert r.useful_s.tolist() == [pytest.approx(1e-6 * DAY, rel=1e-12)]
    assert r.effective.tolist() == [pytest.approx(1.0, rel=1e-12)]


def _available() -> int:
    lines = Path("/proc/meminfo").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:"))


def test_a_run_is_refused_past_half_the_available_memory_with_its_size():
    """160 B per run and slot (111 B measured, and a margin) against half of MemAvailable, both
    in GiB to one decimal (the limit as read just before or just after: it drifts)."""
    slots = 1000
    faults._check_size(int(0.4 * _available() / 160 / slots), slots)
    runs = int(0.6 * _available() / 160 / slots)
    before = _available()
    with pytest.raises(FourdError) as refused:
        faults._check_size(runs, slots)
    after = _available()
    found = re.fullmatch(
        f"{runs:,} runs of 1,000 interruption slots each need about "
        f"{runs * slots * 160 / 2**30:,.1f} GiB, more than the ([0-9,.]+) GiB this machine can "
        "give: use fewer runs or fewer days",
        str(refused.value),
    )
    assert found, str(refused.value)
    assert found[1] in {f"{free // 2 / 2**30:,.1f}" for free in (before, after)}


def test_two_runs_of_four_slots_gap_by_gap():
    """τ = 10 s, δ = 2 s, R = 5 s, horizon 100 s. Each gap: the pause after the previous
    interruption (R, and δ after a planned stop; none at the start; cut short by the next
    interruption), then whole cycles of τ + δ, then the rest: saved up to τ when a planned stop or
    the horizon ends the gap, lost up to τ when a failure does; beyond τ it was saving."""
    arrivals = np.array([[30.0, 50.0, 200.0, 300.0], [23.0, 26.0, 150.0, 160.0]])
    happened = arrivals < 100
    planned = np.array([[False, True, False, False], [False] * 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing for `fourd sim faults` to print beside its result
        useful, lost, downtime, ckpt, live = faults._spans(
            arrivals, happened, planned, 100.0, (10.0, 2.0, 5.0)
        )
    # run 0: 0-30 failed (2 cycles, 6 s lost); 30-50 planned (R, 1 cycle, 3 s saved); 50-100 (R + δ,
    # 3 cycles, 7 s saved); slot 3 starts past the horizon
    # run 1: 0-23 failed while saving (1 cycle, the next 10 s lost, 1 s of a save); 23-26 failed
    # during the restart; 26-100 (R, 5 cycles, 9 s saved)
    assert useful.tolist() == [[20, 13, 37, 0], [10, 0, 59, 0]]
    assert lost.tolist() == [[6, 0, 0, 0], [10, 0, 0, 0]]
    assert downtime.tolist() == [[0, 5, 7, 0], [0, 3, 5, 0]]
    assert ckpt.tolist() == [[4, 2, 6, 0], [3, 0, 10, 0]]
    assert live.tolist() == [[True, True, True, False], [True, True, True, False]]


def test_no_run_runs_out_of_interruption_slots():
    """Slots = mean + 8σ + 16 arrivals: the counts keep a Poisson law's spread (variance = mean,
    466 on 16,384 GPUs in 54 days); a run short of slots would stop counting near its last one."""
    r = faults.simulate(16384, 54, runs=1000, seed=5)
    counts = r.unexpected + r.planned
    assert 0.85 < counts.var() / counts.mean() < 1.15
    assert sum(r.by_component.values()) == pytest.approx(r.unexpected.mean(), rel=1e-12)


def test_interruptions_less_than_a_second_apart_keep_their_rate():
    """10⁸ GPUs: 419 / 54 × 10⁸ / 16,384 + 47 / 54 a day, 0.55 a second (one every 1.8 s): 474
    in 864 s."""
    r = faults.simulate(10**8, 0.01, runs=200, seed=0)
    per_day = sum(faults.unexpected_per_day(10**8).values()) + faults.planned_per_day()
    assert (r.unexpected + r.planned).mean() == pytest.approx(per_day * 0.01, rel=0.01)


def _result(by_component: dict[str, float]) -> faults.FaultResult:
    """Two runs of one day on 16,384 GPUs, their times written by hand."""
    return faults.FaultResult(
        gpus=16384,
        days=1.0,
        runs=2,
        interval_s=600.0,
        checkpoint_s=10.0,
        restart_s=300.0,
        unexpected=np.array([6, 9]),
        planned=np.array([1, 2]),
        by_component=by_component,
        useful_s=np.array([0.9, 0.8]) * DAY,
        lost_s=np.array([3600.0, 10800.0]),
        restart_total_s=np.array([1800.0, 5400.0]),
        checkpoint_total_s=np.array([720.0, 1440.0]),
    )


def test_a_result_is_an_immutable_value_named_by_keywords():
    result = _result({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.runs = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        faults.FaultResult(*dataclasses.astuple(result))  # type: ignore[misc]


def test_the_summary_of_two_runs_written_by_hand():
    table = {name: float(count) for name, (count, _) in faults.TABLE5.items()}
    s = faults.summary(_result(table))
    mtbf = 54 * DAY / 419  # the job's, on Table 5's 16,384 GPUs
    assert s == {
        "unexpected_interruptions": 7.5,
        "planned_interruptions": 1.5,
        "effective_training_fraction": pytest.approx(0.85, rel=1e-12),
        "checkpoint_interval_min": 10.0,
        "optimal_checkpoint_interval_min": pytest.approx(
            faults.daly_interval(10.0, mtbf) / 60, rel=1e-12
        ),
        "young_interval_min": pytest.approx((2 * 10 * mtbf) ** 0.5 / 60, rel=1e-12),
        "mtbf_h": pytest.approx(54 * 24 / 419, rel=1e-12),
        # numpy's linear percentiles of two values: 0.8 + 0.05 · 0.1 and 0.8 + 0.95 · 0.1
        "effective_training_fraction_p5": pytest.approx(0.805, rel=1e-12),
        "effective_training_fraction_p95": pytest.approx(0.895, rel=1e-12),
        "gpus": 16384,
        "days": 1.0,
        "runs": 2,
        "checkpoint_save_s": 10.0,
        "restart_s": 300.0,
        "lost_work_h": 2.0,
        "restart_h": 1.0,
        "checkpointing_h": 0.3,
        # Table 5's hardware: 148 + 72 + 35 + 19 + 17 + 7 + 6 + 6 + 3 + 3 + 2 · 4 of the 419
        "hardware_share": pytest.approx(324 / 419, rel=1e-12),
        "components": table,
    }
    assert list(s)[:3] == [
        "unexpected_interruptions",
        "planned_interruptions",
        "effective_training_fraction",
    ]
    assert faults.summary(_result(dict.fromkeys(table, 0.0)))["hardware_share"] == 0.0


def test_the_figures_docs_simulators_md_quotes_for_seed_0():
    """16,384 GPUs, 54 days, 1,000 runs, seed 0: 418.8 unexpected and 46.9 planned interruptions,
    77 % hardware, a checkpoint every 7.8 min, 26.6 h redone, 38.4 h of restarts, 25.8 h of
    checkpointing, 93.0 % effective."""
    s = faults.summary(faults.simulate(16384, 54, runs=1000, seed=0))
    assert [
        round(s[key], 1)
        for key in (
            "unexpected_interruptions",
            "planned_interruptions",
            "checkpoint_interval_min",
            "lost_work_h",
            "restart_h",
            "checkpointing_h",
        )
    ] == [418.8, 46.9, 7.8, 26.6, 38.4, 25.8]
    assert (round(100 * s["hardware_share"]), round(100 * s["effective_training_fraction"], 1)) == (
        77,
        93.0,
    )


@pytest.mark.parametrize(
    "available_kib,runs,slots,refused",
    [
        # 8 GiB available, half of it 4,294,967,296 B: 26,843,545 slots of 160 B fit, one more does not
        (8 * 2**20, 1, 26_843_545, False),
        (8 * 2**20, 1, 26_843_546, True),
        (8 * 2**20, 2, 13_421_773, True),
        # 1,000 kB available: half of it 512,000 B, exactly 3,200 slots of 160 B, accepted
        (1000, 1, 3_200, False),
        (1000, 1, 3_201, True),
    ],
)
def test_the_size_limit_is_half_of_memavailable_to_the_byte(
    tmp_path, available_kib, runs, slots, refused
):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        f"MemTotal:       {2 * available_kib} kB\nMemAvailable:   {available_kib} kB\n"
    )
    if not refused:
        faults._check_size(runs, slots, meminfo)
        return
    with pytest.raises(FourdError) as error:
        faults._check_size(runs, slots, meminfo)
    need, limit = runs * slots * 160 / 2**30, available_kib * 1024 // 2 / 2**30
    assert str(error.value) == (
        f"{runs:,} runs of {slots:,} interruption slots each need about {need:,.1f} GiB, more than the "
        f"{limit:,.1f} GiB this machine can give: use fewer runs or fewer days"
    )


def test_the_size_in_the_refusal_is_in_tenths_of_a_gib(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   1048576 kB\n")  # 1 GiB: half of it 0.5 GiB
    with pytest.raises(FourdError, match=r"need about 0\.7 GiB, more than the 0\.5 GiB"):
        faults._check_size(1, 5_000_000, meminfo)  # 800,000,000 B


@pytest.mark.parametrize(
    "text", [None, "MemTotal:       1024 kB\n"], ids=["no file", "no MemAvailable"]
)
def test_without_memavailable_the_limit_is_half_of_the_physical_memory(tmp_path, text):
    meminfo = tmp_path / "meminfo"
    if text is not None:
        meminfo.write_text(text)
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    faults._check_size(1, limit // 160, meminfo)
    with pytest.raises(FourdError, match="more than the"):
        faults._check_size(1, limit // 160 + 1, meminfo)


def test_the_default_seed_is_0():
    args = dict(gpus=16384, days=2.0, runs=3)
    assert (
        faults.simulate(**args).useful_s.tolist()
        == faults.simulate(**args, seed=0).useful_s.tolist()
    )
    assert (
        faults.simulate(**args).useful_s.tolist()
        != faults.simulate(**args, seed=1).useful_s.tolist()
    )


def test_a_simulation_raises_no_numpy_warning():
    """Every array operation is defined on its inputs: no division by zero, no overflow, no invalid value."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        faults.simulate(16384, 5.0, runs=20, seed=3)
        faults.simulate(8, 1.0, runs=5, interval_s=60.0, checkpoint_s=0.0, restart_s=0.0, seed=4)
