"""`fourd train` end to end, for what only whole runs show (real processes, the debug model, 2 ranks):

- a SIGTERM that reaches one worker alone (as a cluster's scheduler or torchrun's agent sends it) stops every
  rank at the next step boundary: exit status 143, the one line, a checkpoint, and `--resume` continues
  exactly;
- a fine-tuning run (`--init-from`) that resumes continues from its own checkpoint, not from the initial
  weights again: its losses are bit-identical to the uninterrupted run's (2 ranks, a SIGTERM), and on one rank
  the resumed step's loss is the checkpoint's weights' (the mutation suite's fast check of the same).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_fourd

from fourd.ckpt import store
from fourd.data.dataset import SampleStream
from fourd.data.dataset import prepare as prepare_data
from fourd.hf.convert import _rotary, hf_config, hf_name, write_hf
from fourd.model.config import get_preset
from fourd.model.llama import build_model
from fourd.parallel.apply import cross_entropy

pytestmark = pytest.mark.slow
STEPS = 8  # the SIGTERM test signals after step 1: seven steps of margin under a loaded machine


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    words = random.Random(1).choices(["a", "ring", "of", "ranks", "sends", "chunks", "."], k=12000)
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(" ".join(words))
    return path


def _common(corpus, steps=STEPS):
    return (
        "--data.path",
        corpus,
        "--data.seq_len=32",
        "--train.global_batch=4",
        "--seed",
        5,
        "--steps",
        steps,
        "--layout",
        "dp=2",
    )


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, filter(None, lines))}


def _children(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _parent(pid: int) -> int:
    """The parent process of `pid` (from /proc), or -1 once it has ended."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _workers(pid: int) -> list[int]:
    """The training workers launcher `pid` started, oldest first: multiprocessing's spawned
    children, or (CPU runs) the children of its forkserver, which is itself the launcher's child."""
    found = []
    for child in sorted(_children(pid)):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" in cmdline:
            continue
        spawned = b"spawn_main" in cmdline
        forked = b"multiprocessing.forkserver" in cmdline and _parent(child) != pid
        if spawned or forked:
            found.append(child)
    return found


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Hugging Face weights to fine-tune from: the debug model of another seed, exported in this process."""
    cfg = get_preset("debug")
    weights = build_model(cfg, seed=11).state_dict()
    tensors = {
        hf_name(k): _rotary(cfg, k, v, inverse=False).contiguous() for k, v in weights.items()
    }
    folder = tmp_path_factory.mktemp("source") / "hf"
    write_hf(folder, hf_config(cfg, torch.float32), tensors, shard_bytes=1 << 40)
    return folder


@pytest.fixture(scope="module")
def uninterrupted(corpus, source, tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    code, out, err = run_fourd(
        "train", *_common(corpus), "--init-from", source, "--run-dir", run, timeout=600
    )
    assert code == 0, err
    assert f"fourd: starting from the weights of {source}" in out
    return run, out


@pytest.fixture(scope="module")
def uninterrupted_losses(uninterrupted):
    return _losses(uninterrupted[0])


@pytest.mark.timeout(900)
def test_two_cpu_ranks_measure_tokens_per_s_and_mfu_against_one_shared_peak(uninterrupted):
    """On a CPU the ranks share the cores the peak was measured on: MFU's denominator is that one peak, not
    one per rank (on GPUs it is every GPU's); tokens per second count the global batch's tokens."""
    run, out = uninterrupted
    # the peak `fourd train` used, as its summary prints it (3 decimals): within 5 %, far from twice it
    peak = float(re.search(r"MFU peak +([\d.]+) TFLOP/s", out).group(1)) * 1e12
    assert peak > 0, out
    tokens = 4 * 32  # train.global_batch × data.seq_len, whatever the layout
    flops = get_preset("debug").flops_per_token(32) * tokens
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(tokens / row["step_time_s"], rel=1e-12)
        assert row["tokens"] == row["step"] * tokens
        assert row["mfu"] == pytest.approx(flops / row["step_time_s"] / peak, rel=0.05)


@pytest.mark.timeout(900)
def test_sigterm_to_one_worker_stops_all_and_a_resumed_fine_tuning_run_continues_exactly(
    corpus, source, uninterrupted_losses, tmp_path
):
    run = tmp_path / "run"
    cmd = ("train", *_common(corpus), "--init-from", source, "--run-dir", run)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fourd", *map(str, cmd)],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    workers = _workers(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGTERM)  # one worker alone: the ranks must agree to stop
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    stopped = int(re.search(r"after step (\d+);", err).group(1))
    assert 1 <= stopped < STEPS
    assert err.splitlines() == [
        f"fourd: stopped by SIGTERM after step {stopped}; checkpoint {run}/checkpoints/step-{stopped} "
        f"saved; continue with `fourd train --resume {run}`"
    ]
    assert (run / "checkpoints" / f"step-{stopped}" / "manifest.json").is_file()
    assert sorted(_losses(run)) == list(range(1, stopped + 1))

    code, out, err = run_fourd("train", "--resume", run, timeout=600)
    assert code == 0, err
    assert f"resuming from checkpoint {run}/checkpoints/step-{stopped} at step {stopped}" in out
    assert "starting from the weights" not in out  # the run's own weights, not --init-from's again
    assert _losses(run) == uninterrupted_losses  # bit for bit


@pytest.mark.timeout(600)
def test_a_resumed_fine_tuning_run_starts_from_its_checkpoint_not_from_init_from(
    corpus, source, tmp_path
):
    """One rank, one step, then `--resume` for a second: the second step's loss is the checkpoint's
    weights' on its batch, computed here, and --init-from's weights are not loaded again."""
    run = tmp_path / "run"
    one_rank = ("--layout", "dp=1")
    code, out, err = run_fourd(
        "train", *_common(corpus, steps=1), *one_rank, "--init-from", source, "--run-dir", run
    )
    assert code == 0, err
    assert f"fourd: starting from the weights of {source}" in out
    model_config, weights = store.load_model_checkpoint(run / "checkpoints" / "step-1")
    second_batch = SampleStream(prepare_data(str(corpus), "byte"), 32, 5).samples(4, 4)
    model = build_model(model_config, seed=None)
    model.load_state_dict(weights)
    tokens = torch.from_numpy(second_batch)
    with torch.no_grad():
        want = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).item()

    code, out, err = run_fourd("train", "--resume", run, "--steps", 2)
    assert code == 0, err
    assert f"resuming from checkpoint {run}/checkpoints/step-1 at step 1" in out
    assert "starting from the weights" not in out
    assert _losses(run)[2] == pytest.approx(want, rel=1e-5)
