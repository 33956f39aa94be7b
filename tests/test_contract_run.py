"""What one `fourd train` run leaves behind, held against the contract's lines (real processes, the debug model):

- `DIR/metrics.jsonl`: one row per optimizer step with `step`, `loss`, `lr`, `grad_norm`, `tokens_per_s`,
  `step_time_s`, `mfu`, and `val_loss` at every `--eval.every` steps;
- the data order, the initial weights and the held-out windows depend on the seed and config only: a 2-rank
  run's losses, gradient norms and held-out losses are one process's, replayed here step by step from the
  run's own `config.toml`;
- `DIR/config.toml` holds the whole resolved configuration, and each checkpoint's manifest records the same;
- `--max-restarts 1` with `--fault.kill-rank R --fault.at-step S`: the rank dies at step S of the first attempt
  only, every worker restarts from the newest complete checkpoint, and the run ends bit-identical to the
  uninterrupted one.
"""

from __future__ import annotations

import json
import random
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from conftest import run_fourd

from fourd.ckpt import store
from fourd.config import Config, set_value
from fourd.data.dataset import SampleStream
from fourd.data.dataset import prepare as prepare_data
from fourd.parallel.apply import build_parallel
from fourd.train.step import build_optimizer, eval_step, lr_at, train_step

pytestmark = pytest.mark.slow
STEPS, EVERY, INTERVAL = 6, 2, 2
SEQ, BATCH, SEED, HOLDOUT = 32, 4, 7, 0.05
CONTRACT_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    words = random.Random(2).choices(
        ["each", "rank", "reads", "its", "own", "windows", "."], k=12000
    )
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(" ".join(words))
    return path


def _train(corpus, run_dir: Path, *extra) -> tuple[int, str, str]:
    return run_fourd(
        "train",
        *("--model", "debug", "--layout", "dp=2", "--seed", SEED, "--steps", STEPS),
        *("--data.path", corpus, f"--data.seq_len={SEQ}", f"--data.holdout_fraction={HOLDOUT}"),
        *(f"--train.global_batch={BATCH}", "--eval.every", EVERY, "--eval.batches", 2),
        *("--checkpoint.interval", INTERVAL, "--run-dir", run_dir, *extra),
        timeout=600,
    )


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The uninterrupted 2-rank run."""
    run = tmp_path_factory.mktemp("straight") / "run"
    code, out, err = _train(corpus, run)
    assert code == 0, err
    return run


def _replay(run_dir: Path, corpus) -> list[dict]:
    """The run's steps in this one process, from its config.toml: the loss and gradient norm of every step,
    and the held-out loss at every `eval.every` steps over the first `eval.batches` batches of the tail."""
    cfg = Config.from_dict(tomllib.loads((run_dir / "config.toml").read_text()))
    set_value(cfg, "parallel.layout", "dp=1")
    par = build_parallel(cfg, torch.device("cpu"), 0, 1)
    opt = build_optimizer(par, cfg)
    stream = SampleStream(prepare_data(str(corpus), "byte"), SEQ, SEED, HOLDOUT)
    tail = stream.holdout()
    out = []
    for step in range(1, cfg.train.steps + 1):
        batch = torch.from_numpy(stream.samples((step - 1) * BATCH, BATCH))
        loss, grad_norm = train_step(
            par, opt, batch[:, :-1], batch[:, 1:], lr_at(step, cfg), cfg, nullcontext
        )
        row = {"step": step, "loss": loss, "grad_norm": float(grad_norm)}
        if step % EVERY == 0:
            held = []
            for first in range(0, cfg.eval.batches * BATCH, BATCH):
                windows = [tail[k * SEQ : (k + 1) * SEQ + 1] for k in range(first, first + BATCH)]
                tokens = torch.from_numpy(np.stack(windows))
                held.append(eval_step(par, opt, tokens[:, :-1], tokens[:, 1:], cfg, nullcontext))
            row["val_loss"] = float(np.mean(held))
        out.append(row)
    return out


@pytest.mark.timeout(600)
def test_two_ranks_train_on_one_processs_tokens_and_log_every_contract_field(straight, corpus):
    rows = _rows(straight)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(set(row) >= CONTRACT_KEYS for row in rows)
    assert [row["step"] for row in rows if "val_loss" in row] == [2, 4, 6]
    cfg = Config.from_dict(tomllib.loads((straight / "config.toml").read_text()))
    flops_per_step = rows[0]["mfu"] * rows[0]["step_time_s"]  # the same FLOPs / peak at every step
    for row in rows:
        assert row["lr"] == lr_at(row["step"], cfg)  # the scheduled rate, to the bit
        assert row["tokens_per_s"] == pytest.approx(BATCH * SEQ / row["step_time_s"], rel=1e-12)
        assert row["mfu"] * row["step_time_s"] == pytest.approx(flops_per_step, rel=1e-12)
    # the same tokens in the same order, the same initial weights and held-out windows as one process
    for row, want in zip(rows, _replay(straight, corpus), strict=True):
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=1e-5), (row["step"], key)


@pytest.mark.timeout(600)
def test_config_toml_is_the_whole_resolved_configuration_and_every_manifest_records_it(
    straight, corpus
):
    text = (straight / "config.toml").read_text()
    recorded = tomllib.loads(text)
    written = {section: dict(values) for section, values in Config().to_dict().items()}
    # every key of every section is written out, unset model keys alone left out
    for section, values in written.items():
        set_keys = {key for key, value in values.items() if value is not None}
        assert set(recorded[section]) == set_keys, section
    cfg = Config.from_dict(recorded)
    assert (cfg.train.seed, cfg.train.steps, cfg.train.global_batch) == (SEED, STEPS, BATCH)
    assert (cfg.data.path, cfg.data.seq_len, cfg.data.holdout_fraction) == (
        str(corpus),
        SEQ,
        HOLDOUT,
    )
    assert (cfg.parallel.layout, cfg.eval.every, cfg.checkpoint.interval) == (
        "dp=2",
        EVERY,
        INTERVAL,
    )
    assert cfg.run.dir == str(straight)
    for step in (2, 4, 6):
        manifest = store.read_manifest(straight / "checkpoints" / f"step-{step}")
        assert manifest["train"]["config"] == cfg.to_dict(), step


@pytest.fixture(scope="module")
def killed(corpus, tmp_path_factory):
    """The same run with rank 1 killed at the start of step 4 of the first attempt, one restart allowed."""
    run = tmp_path_factory.mktemp("killed") / "run"
    code, out, err = _train(
        corpus, run, "--max-restarts", 1, "--fault.kill-rank", 1, "--fault.at-step", 4
    )
    assert code == 0, err
    return run, out


@pytest.mark.timeout(600)
def test_a_rank_killed_once_is_restarted_from_the_newest_checkpoint(killed):
    run, out = killed
    # killed at the start of step 4: the newest complete checkpoint is step 2's, steps 3 onwards are run again
    assert (
        f"resuming after restart 1 from checkpoint {run}/checkpoints/step-2 at step 2, " in out
    ), out
    assert f"sample {2 * BATCH}\n" in out, out
    assert [row["step"] for row in _rows(run)] == list(range(1, STEPS + 1))  # one row per step
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == [
        "step-2",
        "step-4",
        "step-6",
    ]


@pytest.mark.timeout(600)
def test_the_restarted_run_ends_bit_identical_to_the_uninterrupted_one(killed, straight):
    rows, want = _rows(killed[0]), _rows(straight)
    for key in ("loss", "grad_norm", "lr"):
        assert [row[key] for row in rows] == [row[key] for row in want], key
    assert [row.get("val_loss") for row in rows] == [row.get("val_loss") for row in want]
    final = (
        store.read_manifest(d / "checkpoints" / f"step-{STEPS}")["model_digest"]
        for d in (killed[0], straight)
    )
    assert len(set(final)) == 1
