"""Checkpoint faults on a 2-rank job (dp=2, the cheapest real distributed run): a rank killed in the
middle of a save, a bit-flipped and a truncated file, a disk that fills during a save, a hung rank,
retention. Every run is a real `fourd train` through the elastic launcher."""

import json
import resource
import shutil

import pytest
import tomllib
from conftest import run_fourd

from fourd.ckpt import store
from fourd.config import Config

pytestmark = pytest.mark.slow
BASE = (
    "train",
    "--model",
    "debug",
    "--layout",
    "dp=2",
    "--seed",
    0,
    "--steps",
    6,
    "--checkpoint.interval",
    2,
)


def rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]


def digest(run_dir, step):
    return store.read_manifest(run_dir / "checkpoints" / f"step-{step}")["model_digest"]


def ckpts(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The uninterrupted reference: 6 steps, a checkpoint every 2, the last 2 kept."""
    d = tmp_path_factory.mktemp("clean")
    code, out, err = run_fourd(*BASE, "--checkpoint.keep", 2, "--run-dir", d)
    assert code == 0, err
    return d


def test_retention_keeps_the_newest_two(clean):
    assert ckpts(clean) == ["step-4", "step-6"]
    assert [r["step"] for r in rows(clean)] == [1, 2, 3, 4, 5, 6]
    m = store.verify(clean / "checkpoints" / "step-6")
    assert m["step"] == 6 and m["layout"] == "tp=1,cp=1,pp=1,dp=2"
    assert (m["train"]["step"], m["train"]["samples"]) == (6, 96)
    assert (
        m["train"]["config"]
        == Config.from_dict(tomllib.loads((clean / "config.toml").read_text())).to_dict()
    )
    assert (
        m["train"]["config"]["train"]["steps"] == 6
        and m["train"]["config"]["parallel"]["layout"] == "dp=2"
    )
    data = m["train"]["data"]
    assert (data["path"], data["tokenizer"], data["identity"]) == ("", "byte", "byte")
    assert data["source"].startswith("Python standard library (") and data["tokens"] > 10**6
    assert sorted(m["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_kill_during_save_ignores_the_partial_one(clean, tmp_path):
    # rank 0 dies after every rank wrote its data files for step 4, before it writes the manifest
    code, out, err = run_fourd(
        *BASE, "--max-restarts", 1, "--run-dir", tmp_path, env={"FOURD_FAULT_KILL_IN_SAVE": "0@4"}
    )
    assert code == 0, err
    assert f"ignoring the incomplete checkpoint {tmp_path}/checkpoints/.step-4.partial" in err
    assert (
        f"resuming after restart 1 from checkpoint {tmp_path}/checkpoints/step-2 at step 2" in out
    )
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert digest(tmp_path, 6) == digest(clean, 6)
    assert ckpts(tmp_path) == ["step-2", "step-4", "step-6"]


def test_bit_flip_is_named_and_training_falls_back(clean, tmp_path, fourd):
    run = tmp_path / "run"
    shutil.copytree(clean, run)
    shard = run / "checkpoints" / "step-6" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x10]))
    code, out, err = fourd("ckpt", "verify", run / "checkpoints" / "step-6")
    assert code == 2 and f"{shard}: SHA-256 differs from manifest.json" in err
    code, out, err = fourd(*BASE, "--checkpoint.keep", 2, "--run-dir", run, "--resume")
    assert code == 0, err
    # one line says both: what was damaged and moved aside, and where training resumes
    (warning,) = [line for line in err.splitlines() if "warning" in line]
    assert warning == (
        f"fourd: warning: checkpoint step-6 is damaged ({shard}: SHA-256 differs from manifest.json"
        "; the file is damaged); moved it to step-6.damaged; falling back to the previous "
        "complete checkpoint step-4"
    ), err
    assert f"resuming from checkpoint {run}/checkpoints/step-4 at step 4, sample 64" in out
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4, 5, 6]
    assert digest(run, 6) == digest(clean, 6)  # recomputed steps 5 and 6 exactly
    assert ckpts(run) == ["step-4", "step-6", "step-6.damaged"]


def test_truncated_file_is_named(clean, tmp_path, fourd):
    ck = tmp_path / "step-4"
    shutil.copytree(clean / "checkpoints" / "step-4", ck)
    with open(ck / ".metadata", "r+b") as f:
        f.truncate(100)
    code, out, err = fourd("ckpt", "verify", ck)
    assert code == 2 and f"{ck}/.metadata: 100 bytes, manifest says" in err
    (ck / "manifest.json").unlink()
    code, out, err = fourd("ckpt", "verify", ck)
    assert code == 2 and "no manifest.json; not a fourd checkpoint" in err


def _small_files():
    # 1 MB per file: more than every file of the run but a rank's checkpoint shard (1.5 MB)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_disk_full_during_save_keeps_the_previous_checkpoint(clean, tmp_path):
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(clean / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.run(
        [sys.executable, "-m", "fourd", *map(str, BASE), "--run-dir", str(run), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        preexec_fn=_small_files,
    )
    assert p.returncode == 2, p.stderr
    assert "checkpoint step-6 was not saved: rank " in p.stderr
    assert "a file-size limit of 1,048,576 bytes (ulimit -f)" in p.stderr
    assert "the newest complete checkpoint, step-4, is intact" in p.stderr
    assert ckpts(run) == ["step-4"]  # no partial directory left behind
    store.verify(run / "checkpoints" / "step-4")


def test_hung_rank_is_named_and_the_job_restarts(tmp_path):
    code, out, err = run_fourd(
        "train",
        "--model",
        "debug",
        "--layout",
        "dp=2",
        "--seed",
        0,
        "--steps",
        4,
        "--checkpoint.interval",
        2,
        "--fault.hang_rank",
        1,
        "--fault.at_step",
        3,
        "--train.timeout_s",
        15,
        "--max-restarts",
        1,
        "--run-dir",
        tmp_path,
    )
    assert code == 0, err
    assert (
        "rank 0: step 3 failed" in err and "did not begin step 3: rank 1 (last began step 2)" in err
    )
    assert (
        f"resuming after restart 1 from checkpoint {tmp_path}/checkpoints/step-2 at step 2" in out
    )
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4]


def test_async_save_writes_the_weights_of_its_step(clean, tmp_path):
    code, out, err = run_fourd(
        *BASE, "--checkpoint.keep", 2, "--checkpoint.async_save", "true", "--run-dir", tmp_path
    )
    assert code == 0, err
    assert ckpts(tmp_path) == ["step-4", "step-6"]
    for step in (4, 6):
        # the data files were written while training went on; loading checks them against the digest
        # taken when the save began, and that digest against the synchronous run's
        store.load_model_checkpoint(tmp_path / "checkpoints" / f"step-{step}")
        assert digest(tmp_path, step) == digest(clean, step)
