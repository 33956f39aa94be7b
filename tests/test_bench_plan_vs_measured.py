"""benchmarks/plan_vs_measured.py --rounds: every layout trained once a round, in turn, and each
layout's median over the rounds kept, with the rounds' times and the anchor of its median round."""

import json
import os
import statistics
import subprocess
import sys

import pytest
from conftest import ROOT


def test_a_layouts_rounds_are_judged_by_their_median_and_its_nearest_round():
    """Three rounds of 1.5, 2.0 and 1.0 s: the median 1.5 s (not the last round's 1.0), every time in
    order, and the anchor of the 1.5 s round with the median as its step time."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from plan_vs_measured import median_round
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    runs = [(1.5, {"round": 1}), (2.0, {"round": 2}), (1.0, {"round": 3})]
    assert median_round(runs) == (1.5, [1.5, 2.0, 1.0], {"round": 1, "step_time_s": 1.5})
    two = [(2.0, {"round": 1}), (1.0, {"round": 2})]  # an even count: the mean of the middle two
    assert median_round(two)[0] == 1.5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rounds_keep_every_run_and_judge_the_median(tmp_path):
    saved = tmp_path / "measured.json"
    cmd = [
        sys.executable,
        "benchmarks/plan_vs_measured.py",
        "--model",
        "debug",
        "--cluster",
        "dgx-h100",
        "--only",
        "dp=1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--save",
        str(saved),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    key = "debug dp=1 1f1b m=1 seq=256 batch=16 zero2"
    got = json.loads(saved.read_text())
    rounds = got[f"{key} rounds"]
    assert len(rounds) == 2 and all(seconds > 0 for seconds in rounds)
    assert got[key] == statistics.median(rounds)
    assert got[f"{key} anchor"]["step_time_s"] == got[key]
    assert got[f"{key} anchor"]["layout"] == "tp=1,cp=1,pp=1,dp=1"
    assert done.stderr.count("round 1: dp=1") == 1 and done.stderr.count("round 2: dp=1") == 1
    row = next(line for line in done.stdout.splitlines() if line.startswith("| dp=1 |"))
    measured_cell = row.split("|")[4].strip()
    assert measured_cell == f"{got[key]:.3f} ({min(rounds):.3f}-{max(rounds):.3f})"


def test_rounds_below_one_are_refused():
    cmd = [sys.executable, "benchmarks/plan_vs_measured.py", "--rounds", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--rounds 0: give 1 or more" in done.stderr
