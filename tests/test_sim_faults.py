"""The failure simulator against Llama 3's 54 days, and the checkpoint-interval formulas."""

import json
import math
import subprocess
import sys

import pytest

from fourd.errors import FourdError
from fourd.sim import faults


def test_table5_rates_and_mtbf():
    per_day = faults.unexpected_per_day(16384)
    assert sum(per_day.values()) * 54 == pytest.approx(419, rel=1e-12)
    assert per_day["faulty GPU"] * 54 == pytest.approx(148, rel=1e-12)
    assert faults.mtbf_s(16384) / 3600 == pytest.approx(54 * 24 / 419, rel=1e-12)  # 3.09 h
    assert faults.mtbf_s(8192) == pytest.approx(2 * faults.mtbf_s(16384), rel=1e-12)


def test_young_and_daly_formulas():
    assert faults.young_interval(50, 10_000) == pytest.approx(1000.0)
    # √(2·50·10⁴)·(1 + ⅓·√0.0025 + 0.0025/9) − 50
    assert faults.daly_interval(50, 10_000) == pytest.approx(
        1000 * (1 + 0.05 / 3 + 0.0025 / 9) - 50
    )
    assert faults.daly_interval(300, 100) == 100  # δ ≥ 2M: checkpoint once per MTBF


def test_54_days_on_16384_gpus_matches_llama3():
    s = faults.summary(faults.simulate(16384, 54, runs=1000, seed=0))
    assert abs(s["unexpected_interruptions"] - 419) / 419 <= 0.05
    assert abs(s["planned_interruptions"] - 47) / 47 <= 0.05
    assert s["effective_training_fraction"] > 0.90
    assert 0.76 <= s["hardware_share"] <= 0.79  # Llama 3: "about 78 %"
    assert s["optimal_checkpoint_interval_min"] == pytest.approx(
        faults.daly_interval(faults.CHECKPOINT_S, faults.mtbf_s(16384)) / 60
    )


def test_time_is_accounted_for_and_lost_work_matches_its_expectation():
    r = faults.simulate(16384, 54, runs=300, seed=1, interval_s=1800.0)
    total = r.useful_s + r.lost_s + r.restart_total_s + r.checkpoint_total_s
    assert abs(total - 54 * 86400).max() < 1e-6
    # With free checkpoints and restarts, training time between interruptions is exponential (rate λ of
    # all interruptions) and a failure redoes Y mod τ of it: E = 1/λ − τ·q/(1 − q), q = exp(−λτ).
    tau = 1800.0
    r = faults.simulate(
        16384, 54, runs=300, seed=1, interval_s=tau, checkpoint_s=0.0, restart_s=0.0
    )
    lam = (sum(faults.unexpected_per_day(16384).values()) + faults.planned_per_day()) / 86400
    q = math.exp(-lam * tau)
    assert r.lost_s.sum() / r.unexpected.sum() == pytest.approx(
        1 / lam - tau * q / (1 - q), rel=0.01
    )


def test_daly_interval_beats_half_and_one_and_a_half_times_it():
    m = faults.mtbf_s(16384)
    best = faults.daly_interval(faults.CHECKPOINT_S, m)
    eff = {
        k: faults.simulate(16384, 54, runs=1000, seed=2, interval_s=k * best).effective.mean()
        for k in (0.5, 1.0, 1.5)
    }
    assert eff[1.0] > eff[0.5] and eff[1.0] > eff[1.5]
    # expected overhead δ/τ + τ/2M is 25 % and 8 % larger there; the runs share random numbers
    assert eff[1.0] - eff[0.5] > 0.003 and eff[1.0] - eff[1.5] > 0.001


def _faults(*args):
    return subprocess.run(
        [sys.executable, "-m", "fourd", "sim", "faults", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_json_is_the_librarys_summary_for_the_same_seed():
    out = _faults("--gpus", "16384", "--days", "54", "--runs", "200", "--seed", "3", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == faults.summary(faults.simulate(16384, 54, runs=200, seed=3))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--days", "nan"], "argument --days: nan is out of range"),
        (
            ["--days", "inf"],
            "argument --days: inf is out of range: give a number from 1e-06 to 1000000",
        ),
        (
            ["--days", "1", "--checkpoint-interval-min", "0"],
            "argument --checkpoint-interval-min: 0.0 is out of range",
        ),
        (
            ["--days", "1", "--runs", "0"],
            "argument --runs: 0 is out of range: give a whole number from 1",
        ),
        (["--days", "54", "--runs", "100000000"], "GiB, more than the"),
        (["--days", "100000", "--runs", "100000"], "use fewer runs or fewer days"),
        (["--days", "1", "--seed", "-1"], "argument --seed: -1 is out of range"),
    ],
)
def test_cli_bad_input_is_one_line(args, needle):
    bad = _faults("--gpus", "16384", *args)
    lines = bad.stderr.strip().splitlines()
    assert (
        bad.returncode == 2
        and len(lines) == 1
        and lines[0].startswith("fourd: error:")
        and needle in lines[0]
    ), bad.stderr


def test_library_refuses_what_the_cli_cannot_reach():
    with pytest.raises(FourdError, match="0 GPUs, 1 days, 1000 runs, checkpoint interval"):
        faults.simulate(0, 1)
    with pytest.raises(FourdError, match="inf days, 1000 runs.*must be finite"):
        faults.simulate(16, math.inf)
