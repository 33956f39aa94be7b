"""An 8-rank three-dimensional job (tp=2, pp=2, dp=2) loses a rank to SIGKILL before its first checkpoint
and between two checkpoints, restarts by itself and ends with the same model as the uninterrupted job; a
checkpoint then resumes at dp=4 (DCP resharding) and continues the same loss curve to the last step."""

import json
import random
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
# Checkpoints at steps 4, 8 and 10: a kill at step 3 restarts from scratch, one at step 7 resumes step-4.
KILLS = {3: None, 7: 4}
RANKS = dict(
    zip(KILLS, random.Random(18).sample(range(8), len(KILLS)))
)  # seeded: the same ranks every run


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


@pytest.fixture(scope="module", params=list(KILLS))
def killed(request, tmp_path_factory):
    step, rank = request.param, RANKS[request.param]
    d = tmp_path_factory.mktemp(f"killed-{step}")
    code, out, err = run_fourd(
        *BASE,
        *(
            "--layout",
            "tp=2,pp=2,dp=2",
            "--max-restarts",
            1,
            "--fault.kill-rank",
            rank,
            "--fault.at-step",
            step,
        ),
        *("--run-dir", d),
        timeout=1200,
    )
    assert code == 0, f"kill rank {rank} at step {step}: {err}"
    return d, out, step


@pytest.fixture(scope="module")
def resharded(uninterrupted, tmp_path_factory):
    d = tmp_path_factory.mktemp("c")
    shutil.copytree(uninterrupted / "checkpoints" / "step-4", d / "checkpoints" / "step-4")
    code, out, err = run_fourd(*BASE, "--layout", "dp=4", "--run-dir", d, "--resume", timeout=900)
    assert code == 0, err
    return d, out


@pytest.mark.timeout(2400)
def test_killed_rank_restarts_and_ends_with_the_same_model(uninterrupted, killed):
    d, out, step = killed
    resumed = KILLS[step]
    if resumed is None:
        assert (
            "resuming" not in out
            and "fourd: restart 1: no checkpoint yet, training again from step 1\n" in out
        )
    else:
        samples = resumed * 16
        assert (
            f"resuming after restart 1 from checkpoint {d}/checkpoints/step-{resumed} at step {resumed}, "
            in out
        )
        assert f"sample {samples}\n" in out
    assert manifest(d, STEPS)["model_digest"] == manifest(uninterrupted, STEPS)["model_digest"]
    assert [r["step"] for r in rows(d)] == list(range(1, STEPS + 1))  # one row per step
    assert [r["loss"] for r in rows(d)] == [r["loss"] for r in rows(uninterrupted)]


@pytest.mark.timeout(2400)
def test_digest_does_not_depend_on_the_saving_layout(uninterrupted):
    final = uninterrupted / "checkpoints" / f"step-{STEPS}"
    m = store.verify(final)
    assert m["layout"] == "tp=2,cp=1,pp=2,dp=2" and m["step"] == STEPS
    assert sorted(p.name for p in (uninterrupted / "checkpoints").iterdir()) == [
        "step-10",
        "step-4",
        "step-8",
    ]
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
    for step in range(5, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    # the final weights: equal up to the rounding of another reduction order
    _, a = store.load_model_checkpoint(d / "checkpoints" / f"step-{STEPS}")
    _, b = store.load_model_checkpoint(uninterrupted / "checkpoints" / f"step-{STEPS}")
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)
    assert worst < 1e-4, worst
