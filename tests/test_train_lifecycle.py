"""A run's whole life through real `fourd train` processes: fresh run directories, the recorded configuration,
stopping on SIGINT / SIGTERM and resuming exactly, a diverged run, held-out evaluation, fine-tuning from a
Hugging Face export, and one line for a worker's failure."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tomllib
import torch
from conftest import ROOT, run_fourd

from fourd.ckpt import store
from fourd.config import Config
from fourd.data.dataset import SampleStream
from fourd.data.dataset import prepare as prepare_data
from fourd.model.llama import build_model
from fourd.parallel.apply import cross_entropy

pytestmark = pytest.mark.slow
PICK = random.Random(
    15
)  # the steps at which the runs below are interrupted, drawn once from a fixed seed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    words = random.Random(0).choices(
        ["the", "ring", "sends", "a", "chunk", "to", "its", "next", "rank", "."], k=20000
    )
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(" ".join(words))
    return path


def common(corpus, steps=12):
    return (
        "--model",
        "debug",
        "--data.path",
        corpus,
        "--data.seq_len=64",
        "--train.global_batch=4",
        "--seed",
        3,
        "--data.holdout_fraction=0.1",
        "--steps",
        steps,
    )


def rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in rows(run_dir)}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Uninterrupted runs at 1 and 2 ranks."""
    out = {}
    for world in (1, 2):
        d = tmp_path_factory.mktemp(f"ref{world}") / "run"
        code, _, err = run_fourd(
            "train", *common(corpus), "--layout", f"dp={world}", "--run-dir", d
        )
        assert code == 0, err
        out[world] = losses(d)
    return out


def test_two_runs_without_run_dir_get_two_directories(corpus, tmp_path):
    env = {"TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    firsts = []
    for _ in range(2):
        code, out, err = run_fourd("train", *common(corpus, 2), cwd=tmp_path, env=env)
        assert code == 0, err
        firsts.append(out.splitlines()[0])
    dirs = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "runs").iterdir())
    assert len(dirs) == 2 and all(
        re.fullmatch(r"runs/debug-dp1-\d{8}-\d{6}(-2)?", d) for d in dirs
    ), dirs
    assert (
        sorted(line.split(":")[1].strip() for line in firsts) == dirs
    )  # each named in the first line
    for d in dirs:
        recorded = tomllib.loads((tmp_path / d / "config.toml").read_text())
        cfg = Config.from_dict(recorded)
        assert (
            cfg.to_dict()
            == store.read_manifest(tmp_path / d / "checkpoints" / "step-2")["train"]["config"]
        )
        assert (cfg.run.dir, cfg.data.path, cfg.train.steps, cfg.data.seq_len) == (
            d,
            str(corpus),
            2,
            64,
        )
    assert (
        list((tmp_path / "tmp").glob("fourd-*")) == []
    )  # the launcher's temporary folders are gone

    code, _, err = run_fourd("train", *common(corpus, 2), "--run-dir", dirs[0], cwd=tmp_path)
    assert (code, err) == (
        2,
        f"fourd: error: run directory {dirs[0]} already holds a run: continue it with `fourd train --resume "
        f"{dirs[0]}`, or choose another --run-dir (or leave it out for a fresh one)\n",
    )
    code, _, err = run_fourd("train", "--resume", dirs[0], "--seed", 4, cwd=tmp_path)
    assert (code, err) == (
        2,
        f"fourd: error: --resume: train.seed = 4 contradicts the run's 3 ({dirs[0]}/config.toml): drop it, or "
        "start a new run without --resume\n",
    )


def _interrupt(cmd, run_dir, after_rows, sig, group):
    proc = subprocess.Popen(
        [sys.executable, "-m", "fourd", *map(str, cmd)],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches it
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_rows):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    (os.killpg if group else os.kill)(proc.pid, sig)
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "world,sig,group",
    [(1, signal.SIGINT, True), (2, signal.SIGINT, True), (1, signal.SIGTERM, False)],
    ids=["1-rank-sigint", "2-rank-sigint", "1-rank-sigterm-to-the-launcher"],
)
def test_a_signal_saves_and_resume_continues_exactly(
    corpus, reference, tmp_path, world, sig, group
):
    run = tmp_path / "run"
    at = PICK.randint(2, 8)
    code, out, err = _interrupt(
        ("train", *common(corpus), "--layout", f"dp={world}", "--run-dir", run), run, at, sig, group
    )
    assert code == 128 + sig, err
    stopped = int(re.search(r"after step (\d+);", err).group(1))
    assert at <= stopped < 12 and "stopped by" not in out  # a non-zero exit's line: on stderr
    assert err == (
        f"fourd: stopped by {signal.Signals(sig).name} after step {stopped}; checkpoint "
        f"{run}/checkpoints/step-{stopped} saved; continue with `fourd train --resume {run}`\n"
    )
    assert sorted(losses(run)) == list(range(1, stopped + 1))
    code, out, err = run_fourd("train", "--resume", run)  # every setting from config.toml
    assert code == 0, err
    assert f"resuming from checkpoint {run}/checkpoints/step-{stopped} at step {stopped}" in out
    assert losses(run) == reference[world]  # bit for bit


def test_a_diverged_run_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    run = tmp_path / "run"
    args = (
        "--train.lr=1e30",
        "--train.warmup_steps=0",
        "--checkpoint.interval=1",
        "--run-dir",
        run,
    )
    code, out, err = run_fourd("train", *common(corpus, 6), *args)
    assert code == 1
    assert re.fullmatch(
        r"fourd: error: step 2: the loss is \S+ and the gradient norm \S+: training diverged; the newest "
        rf"checkpoint, {run}/checkpoints/step-1, is kept, and nothing of this step was saved: lower train.lr "
        r"\(it is 1e\+30\)\n",
        err,
    ), err
    assert [r["step"] for r in rows(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
    _, sd = store.load_model_checkpoint(run / "checkpoints" / "step-1")
    assert all(torch.isfinite(t).all() for t in sd.values())


def _loss(state_dict, mcfg, tokens: np.ndarray) -> float:
    model = build_model(mcfg, seed=None)
    model.load_state_dict(state_dict)
    batch = torch.from_numpy(tokens)
    with torch.no_grad():
        return cross_entropy(model(batch[:, :-1]), batch[:, 1:]).item()


@pytest.mark.timeout(900)
def test_held_out_loss_is_the_tails_at_every_layout(corpus, tmp_path):
    evals = {}
    for layout in ("dp=1", "pp=2"):
        run = tmp_path / layout
        args = (
            "--layout",
            layout,
            "--microbatches",
            2,
            "--eval.every",
            2,
            "--eval.batches",
            2,
            "--run-dir",
            run,
        )
        code, out, err = run_fourd("train", *common(corpus, 4), *args)
        assert code == 0, err
        evals[layout] = {
            r["step"]: (r["val_loss"], r["val_ppl"]) for r in rows(run) if "val_loss" in r
        }
        assert sorted(evals[layout]) == [2, 4]
        assert all(
            ppl == pytest.approx(np.exp(loss), rel=1e-12) for loss, ppl in evals[layout].values()
        )
        last = evals[layout][4]
        assert re.search(
            rf"\nheld-out loss +{last[0]:.4f}, perplexity {last[1]:.2f}, at step 4\n", out
        ), out
    for step in (2, 4):
        assert evals["pp=2"][step][0] == pytest.approx(evals["dp=1"][step][0], rel=1e-5)
    # the figure is the step-4 model's mean loss over the first 2 × 4 windows of the held-out tail
    mcfg, sd = store.load_model_checkpoint(tmp_path / "dp=1" / "checkpoints" / "step-4")
    tail = SampleStream(prepare_data(str(corpus), "byte"), 64, 3, 0.1).holdout()
    batches = [
        np.stack([tail[k * 64 : (k + 1) * 64 + 1] for k in range(b * 4, b * 4 + 4)]) for b in (0, 1)
    ]
    assert evals["dp=1"][4][0] == pytest.approx(
        np.mean([_loss(sd, mcfg, b) for b in batches]), rel=1e-5
    )


@pytest.mark.timeout(900)
def test_init_from_a_hugging_face_export_starts_from_its_weights(corpus, tmp_path):
    source = tmp_path / "source"
    code, _, err = run_fourd("train", *common(corpus, 3), "--run-dir", source)
    assert code == 0, err
    hf = tmp_path / "hf"
    code, _, err = run_fourd(
        "convert", "--from", "fourd", source / "checkpoints" / "step-3", "--to", "hf", hf
    )
    assert code == 0, err
    mcfg, sd = store.load_model_checkpoint(source / "checkpoints" / "step-3")
    first_batch = SampleStream(prepare_data(str(corpus), "byte"), 64, 3, 0.1).samples(0, 4)
    want = _loss(sd, mcfg, first_batch)
    for layout in ("dp=1", "tp=2,pp=2"):
        run = tmp_path / layout
        args = ("--init-from", hf, "--layout", layout, "--microbatches", 2, "--run-dir", run)
        code, out, err = run_fourd(
            "train", *common(corpus, 1)[2:], *args, timeout=600
        )  # the model: the source's
        assert code == 0, err
        assert f"fourd: starting from the weights of {hf}" in out
        assert rows(run)[0]["loss"] == pytest.approx(want, rel=1e-5)
    code, _, err = run_fourd("train", *common(corpus, 1), "--model", "small", "--init-from", hf)
    assert (code, err) == (
        2,
        f"fourd: error: --init-from {hf} holds another model (layers 4, not 8; dim 64, not 256; ffn 176, not 704; "
        "heads 4, not 8; kv_heads 2, not 4; head_dim 16, not 32; max_seq 256, not 1024): drop the model settings "
        "to train its model\n",
    )


def test_a_workers_failure_is_one_line(corpus, tmp_path):
    """Resuming, at 2 ranks, a run directory whose checkpoint holds another model: the workers refuse it."""
    source = tmp_path / "source"
    code, _, err = run_fourd("train", *common(corpus, 1), "--run-dir", source)
    assert code == 0, err
    run = tmp_path / "run"
    run.mkdir()
    (source / "checkpoints").rename(run / "checkpoints")
    code, out, err = run_fourd(
        "train", *common(corpus, 1)[2:], "--layout", "dp=2", "--run-dir", run, "--resume"
    )
    assert code == 2
    assert (
        err.startswith(f"fourd: error: {run}/checkpoints/step-1 holds another model: ")
        and err.count("\n") == 1
    )
