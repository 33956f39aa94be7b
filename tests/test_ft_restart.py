"""An 8-rank three-dimensional job (tp=2, pp=2, dp=2) loses a rank to SIGKILL at a random step, restarts
by itself and ends with the same model as the uninterrupted job; its checkpoint then resumes at dp=4
(DCP resharding) and continues the same loss curve. Three real runs shared by the tests below."""

import json
import random
import re
import shutil

import pytest
import torch
from conftest import run_fourd

from fourd.ckpt import store

pytestmark = pytest.mark.slow
STEPS, INTERVAL = 10, 4
BASE = (
    "train",
    "--model",
    "debug",
    "--schedule",
    "1f1b",
    "--microbatches",
    4,
    "--seed",
    0,
    "--steps",
    STEPS,
    "--checkpoint.interval",
    INTERVAL,
)
PICK = random.Random()  # a fresh step and rank each session; the failure message names them
KILL_STEP, KILL_RANK = PICK.randint(2, STEPS), PICK.randrange(8)


def rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]


def manifest(run_dir, step):
    return store.read_manifest(run_dir / "checkpoints" / f"step-{step}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("a")
    code, out, err = run_fourd(*BASE, "--layout", "tp=2,pp=2,dp=2", "--run-dir", d, timeout=900)
    assert code == 0, err
    return d


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    d = tmp_path_factory.mktemp("b")
    code, out, err = run_fourd(
        *BASE,
        "--layout",
        "tp=2,pp=2,dp=2",
        "--max-restarts",
        2,
        "--fault.kill-rank",
        KILL_RANK,
        "--fault.at-step",
        KILL_STEP,
        "--run-dir",
        d,
        timeout=1200,
    )
    assert code == 0, f"kill rank {KILL_RANK} at step {KILL_STEP}: {err}"
    return d, out


@pytest.fixture(scope="module")
def resharded(uninterrupted, tmp_path_factory):
    d = tmp_path_factory.mktemp("c")
    shutil.copytree(uninterrupted / "checkpoints" / "step-4", d / "checkpoints" / "step-4")
    code, out, err = run_fourd(*BASE, "--layout", "dp=4", "--run-dir", d, "--resume", timeout=900)
    assert code == 0, err
    return d, out


@pytest.mark.timeout(2400)
def test_killed_rank_restarts_and_ends_with_the_same_model(uninterrupted, killed):
    d, out = killed
    why = f"(rank {KILL_RANK} killed at step {KILL_STEP})"
    resumed = re.search(r"resuming after restart 1 from checkpoint \S+/step-(\d+) at step (\d+)", out)
    if KILL_STEP <= INTERVAL:
        assert resumed is None, why  # nothing saved yet: the restart begins at step 1
        recomputed = KILL_STEP - 1
    else:
        assert resumed, why
        step = int(resumed.group(1))
        assert step == (KILL_STEP - 1) // INTERVAL * INTERVAL, why
        recomputed = KILL_STEP - 1 - step
    assert recomputed <= INTERVAL, why
    assert manifest(d, STEPS)["model_digest"] == manifest(uninterrupted, STEPS)["model_digest"], why
    assert [r["step"] for r in rows(d)] == list(range(1, STEPS + 1)), why  # one row per step
    assert [r["loss"] for r in rows(d)] == [r["loss"] for r in rows(uninterrupted)], why


@pytest.mark.timeout(2400)
def test_digest_does_not_depend_on_the_saving_layout(uninterrupted):
    final = uninterrupted / "checkpoints" / f"step-{STEPS}"
    m = store.verify(final)
    assert m["layout"] == "tp=2,cp=1,pp=2,dp=2" and m["step"] == STEPS
    assert sorted(p.name for p in (uninterrupted / "checkpoints").iterdir()) == ["step-10", "step-4", "step-8"]
    assert sorted(m["files"]) == [".metadata"] + [f"__{r}_0.distcp" for r in range(8)]
    # loaded whole in this one process, the 8 ranks' shards hash to the digest they computed together
    _, sd = store.load_model_checkpoint(final)
    assert store.model_digest(sd) == m["model_digest"]
    assert all(torch.isfinite(t).all() for t in sd.values())


@pytest.mark.timeout(2400)
def test_resume_at_another_layout_continues_the_loss_curve(uninterrupted, resharded):
    d, out = resharded
    assert "(saved at layout tp=2,cp=1,pp=2,dp=2, resharded to tp=1,cp=1,pp=1,dp=4)" in out
    assert f"from checkpoint {d}/checkpoints/step-4 at step 4, sample 64" in out
    got = {r["step"]: r["loss"] for r in rows(d)}
    want = {r["step"]: r["loss"] for r in rows(uninterrupted)}
    assert sorted(got) == list(range(5, STEPS + 1))
    for step in range(5, 10):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
