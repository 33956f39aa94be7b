"""`fourd train` end to end, through the elastic launcher, as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

from fourd.config import Config
from fourd.train.launch import free_port
from fourd.train.step import lr_at


def rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]


@pytest.fixture(scope="module")
def debug_runs(tmp_path_factory):
    from conftest import run_fourd

    out = []
    for name in ("a", "b"):
        d = tmp_path_factory.mktemp(name)
        code, stdout, stderr = run_fourd("train", "--model", "debug", "--steps", 30, "--seed", 0, "--run-dir", d)
        assert code == 0, stderr
        out.append((d, stdout))
    return out


def test_debug_loss_falls_below_bound(debug_runs):
    d, stdout = debug_runs[0]
    r = rows(d)
    assert [x["step"] for x in r] == list(range(1, 31))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "peak_mem_gb"} <= r[0].keys()
    assert 5.4 < r[0]["loss"] < 5.8  # ≈ ln 256 = 5.55 nats per byte at initialisation
    assert r[-1]["loss"] < 4.0  # measured 3.53 at step 30 (seed 0)
    assert 0 < r[-1]["mfu"] < 1 and r[-1]["tokens_per_s"] > 0
    assert "loss" in stdout and "MFU" in stdout  # the closing summary
    assert (d / "tensorboard").is_dir() and any((d / "tensorboard").iterdir())


def test_same_seed_gives_identical_metrics(debug_runs):
    (a, _), (b, _) = debug_runs
    keys = ("step", "loss", "lr", "grad_norm", "tokens")
    assert [[x[k] for k in keys] for x in rows(a)] == [[x[k] for k in keys] for x in rows(b)]


def test_lr_schedule_warmup_then_cosine():
    cfg = Config()
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.lr, cfg.train.min_lr = 100, 10, 1e-3, 1e-4
    assert lr_at(5, cfg) == pytest.approx(5e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(5.5e-4)
    assert lr_at(100, cfg) == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "no-such-model"], "unknown model preset 'no-such-model'"),
        (["--train.lr=abc"], "train.lr = 'abc' is not a valid float"),
        (["--trian.lr=1"], "unknown config key 'trian.lr'"),
        (["--data.path=/no/such/corpus"], "data path '/no/such/corpus' does not exist"),
        (["--layout", "tp=3"], "tp"),
    ],
)
def test_bad_input_exits_2_with_one_line(fourd, tmp_path, args, needle):
    code, out, err = fourd("train", "--steps", 1, "--run-dir", tmp_path / "r", *args)
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err


def test_bad_config_file_exits_2(fourd, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 'many'\n")
    code, _, err = fourd("train", "--config", f)
    assert code == 2 and "train.steps = 'many' is not a valid int" in err and "Traceback" not in err


@pytest.mark.timeout(240)
def test_two_node_launch_with_c10d_rendezvous(tmp_path):
    """Two launcher agents on 127.0.0.1, as two nodes would run torchrun, one rendezvous endpoint."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", FOURD_HOME=str(tmp_path / "home"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "two-nodes",
        "-m",
        "fourd",
        "train",
        "--model",
        "debug",
        "--layout",
        "dp=2",
        "--steps",
        "3",
        "--seed",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    agents = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    outs = [a.communicate(timeout=200)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    r = rows(tmp_path / "run")
    assert [x["step"] for x in r] == [1, 2, 3] and r[0]["loss"] == pytest.approx(5.6, abs=0.2)
