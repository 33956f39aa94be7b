"""`fourd train` end to end, through the elastic launcher, as a user runs it: the loop's metrics against their
formulas, refusals of bad input in one line, and the two-node launch."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, run_fourd

from fourd.comm.launch import free_port
from fourd.config import Config, fourd_home
from fourd.model.config import get_preset
from fourd.plan.cluster import PRESET_DIR, load_cluster
from fourd.train.step import lr_at

DEBUG = ("--model", "debug", "--seed", 0)


def rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A FOURD_HOME whose `local` profile is the DGX H100 one: the MFU peak is a known 989 TFLOP/s."""
    h = tmp_path_factory.mktemp("home")
    (h / "clusters").mkdir()
    shutil.copy(PRESET_DIR / "dgx-h100.toml", h / "clusters" / "local.toml")
    return h


# the token cache of the user's home: tokenizing the standard library again would cost every test
CACHE = f"--data.cache_dir={fourd_home() / 'cache'}"


def train(home, *args, timeout=300):
    return run_fourd("train", *args, CACHE, env={"FOURD_HOME": str(home)}, timeout=timeout)


@pytest.fixture(scope="module")
def debug_runs(home, tmp_path_factory):
    out = []
    for name in ("a", "b"):
        d = tmp_path_factory.mktemp(name) / "run"
        code, stdout, stderr = train(home, *DEBUG, "--steps", 30, "--run-dir", d)
        assert code == 0, stderr
        out.append((d, stdout))
    return out


@pytest.mark.slow
def test_debug_loss_falls_below_bound(debug_runs):
    d, stdout = debug_runs[0]
    r = rows(d)
    assert [x["step"] for x in r] == list(range(1, 31))
    keys = {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
        "mfu",
        "hfu",
        "peak_mem_gb",
        "tokens",
    }
    assert set(r[0]) == keys
    assert 5.4 < r[0]["loss"] < 5.8  # ≈ ln 256 = 5.55 nats per byte at initialisation
    assert r[-1]["loss"] < 4.0  # measured 3.53 at step 30 (seed 0)
    assert stdout.splitlines()[0].startswith(
        f"fourd train: {d}: debug model, 218K parameters, layout "
    )
    assert "MFU peak      989.000 TFLOP/s, the `fourd calibrate` profile of this machine" in stdout
    assert (d / "tensorboard").is_dir() and any((d / "tensorboard").iterdir())


@pytest.mark.slow
def test_metrics_are_their_formulas_of_the_step_time(home, debug_runs):
    d, _ = debug_runs[0]
    batch, seq = Config().train.global_batch, Config().data.seq_len
    flops_per_step = get_preset("debug").flops_per_token(seq) * batch * seq
    peak = load_cluster(str(home / "clusters" / "local.toml")).gpu.peak_tflops * 1e12
    memory = [x["peak_mem_gb"] for x in rows(d)]
    for x in rows(d):
        assert x["tokens_per_s"] == pytest.approx(batch * seq / x["step_time_s"], rel=1e-12)
        assert x["mfu"] == pytest.approx(flops_per_step / x["step_time_s"] / peak, rel=1e-12)
        assert x["tokens"] == x["step"] * batch * seq
    # the rank's resident peak: torch alone holds more than 0.15 GB, the debug model adds little; a peak never falls
    assert 0.15 < memory[0] < 3 and memory == sorted(memory)


@pytest.mark.slow
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


PRESETS = "debug, small, llama3-8b, llama3-70b, llama3-405b"
SECTIONS = "model, data, train, parallel, checkpoint, eval, fault, run"
REFUSALS = [
    (["--model", "no-such-model"], f"model.preset = 'no-such-model': allowed values are {PRESETS}"),
    (
        ["--model", "smal"],
        f"model.preset = 'smal' (did you mean `small`?): allowed values are {PRESETS}",
    ),
    (
        ["--modle", "debug"],
        "unrecognised argument '--modle' (did you mean `--model`?): overrides look like --section.key=value",
    ),
    (["--train.lr=abc"], "train.lr = 'abc' is not a valid finite number"),
    (["--train.lr=nan"], "train.lr = 'nan' is not a valid finite number"),
    (["--train.lr=-inf"], "train.lr = '-inf' is not a valid finite number"),
    (["--train.lr=0"], "train.lr = 0.0 must be positive"),
    (
        ["--trian.lr=1"],
        f"unknown config key 'trian.lr' (did you mean `train`?): sections are {SECTIONS} (use section.key)",
    ),
    (["--train.beta1=1.5"], "train.beta1 = 1.5 must be in [0, 1)"),
    (["--train.timeout_s=0"], "train.timeout_s = 0.0 must be in (0, 1e6] seconds"),
    (
        ["--seed", "99999999999999999999999"],
        "train.seed = 99999999999999999999999 must be in 0 .. 2^63 - 1",
    ),
    (["--model.heads=0"], "model.heads = 0 must be at least 1"),
    (
        ["--fault.kill_rank=7", "--fault.at_step=1"],
        "fault.kill_rank = 7 is not a rank of the 1-rank layout: choose 0 .. 0",
    ),
    (
        ["--fault.at_step=1"],
        "fault.at_step is set but neither fault.kill_rank nor fault.hang_rank: set one, or drop it",
    ),
    (
        ["--data.seq_len=100000"],
        "data.seq_len = 100000 is longer than the model's max_seq = 256: raise --model.max_seq or shorten data.seq_len",
    ),
    (
        ["--data.path=/no/such/corpus"],
        "data path '/no/such/corpus' does not exist: give a text file, a folder of text files or a .jsonl file",
    ),
    (
        ["--data.path=TMP/tiny.txt"],
        "the corpus has 11 tokens, too few for one training sequence: 260 are needed (data.seq_len 256 + 1, plus the held-out 1%); give more text or a smaller data.seq_len",
    ),
    (
        ["--eval.every=5", "--data.holdout_fraction=0"],
        "eval.every: the held-out tail has 0 tokens, less than one batch of 16 x 257: raise data.holdout_fraction or set eval.every = 0",
    ),
    (
        ["--run-dir", ""],
        "--run-dir '' is empty: give a directory, or leave --run-dir out for a fresh one",
    ),
    (
        ["--run-dir", "TMP/tiny.txt"],
        "run directory TMP/tiny.txt: TMP/tiny.txt is a file, not a directory: choose another --run-dir",
    ),
    (
        ["--run-dir", "TMP/tiny.txt/sub"],
        "run directory TMP/tiny.txt/sub: TMP/tiny.txt is a file, not a directory: choose another --run-dir",
    ),
    (["--resume"], "--resume needs the run: --resume DIR, or --run-dir DIR --resume"),
    (
        ["--resume", "TMP/nothing"],
        "--resume TMP/nothing: no such run directory; `ls runs/` lists the runs",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,message", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    (tmp_path / "tiny.txt").write_text("hello world")
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    code, out, err = run_fourd("train", *DEBUG, "--steps", 1, *args, cwd=tmp_path)
    assert (code, err) == (2, f"fourd: error: {message.replace('TMP', str(tmp_path))}\n")
    assert not (tmp_path / "runs").exists()  # nothing half written


@pytest.mark.slow
def test_bad_config_file_exits_2(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 'many'\n")
    code, _, err = run_fourd("train", "--config", f)
    assert (code, err) == (2, "fourd: error: train.steps = 'many' is not a valid int\n")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_node_launch_equals_one_agent(home, tmp_path):
    """Two launcher agents on 127.0.0.1, as two nodes would run torchrun, one rendezvous endpoint; their losses
    are those of one agent running both ranks, so the two nodes reduced their gradients together. Each worker
    ends without the interpreter's finalization (its exit handlers never run), where gloo's threads torn down
    could abort a run that had ended well (SIGABRT, and the agent fails the job)."""
    args = (*DEBUG, "--layout", "dp=2", "--steps", 3)
    code, _, err = train(home, *args, "--run-dir", tmp_path / "one")
    assert code == 0, err
    entry = tmp_path / "entry.py"  # `python -m fourd`, with an exit handler that says when it runs
    entry.write_text(
        "import atexit\nfrom fourd.cli import main\n"
        "atexit.register(print, 'finalized')\nraise SystemExit(main())\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    cmd += [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "two-nodes",
    ]
    cmd += [str(entry), "train", *map(str, args), "--run-dir", str(tmp_path / "two"), CACHE]
    env = dict(os.environ, OMP_NUM_THREADS="1", FOURD_HOME=str(home), PYTHONPATH=str(ROOT))
    agents = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in "ab"
    ]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    assert not any("finalized" in out for out in outs), outs
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [x["step"] for x in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-5
        )
