"""fourd train on one rank against a minimal plain-PyTorch loop: same model, data, batch and optimizer.

Alternates the two (fourd, plain, fourd, plain, ...) in one run so that the machine's load drifts
equally over both, and reports the ratio of median steady-state throughputs (goal >= 0.95).

    .venv/bin/python benchmarks/overhead.py [--model small] [--steps 12] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fourd.config import Config, model_config
from fourd.data.dataset import SampleStream, prepare
from fourd.model.llama import build_model
from fourd.parallel.apply import cross_entropy
from fourd.train.step import param_groups


def fourd_round(model: str, steps: int, threads: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "fourd",
                "train",
                "--model",
                model,
                "--steps",
                str(steps),
                "--run-dir",
                d,
                "--train.log_every=1000",
            ],
            check=True,
            env=env,
            capture_output=True,
        )
        rows = [json.loads(line) for line in open(Path(d) / "metrics.jsonl")]
    return statistics.median(r["tokens_per_s"] for r in rows[2:])


def plain_round(model: str, steps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    cfg = Config()
    cfg.model.preset = model
    mcfg, t = model_config(cfg), cfg.train
    net = build_model(mcfg, seed=t.seed)
    opt = torch.optim.AdamW(
        param_groups([net], t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), foreach=True
    )
    stream = SampleStream(prepare("", "byte"), cfg.data.seq_len, t.seed)
    rates = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = torch.from_numpy(stream.samples(step * t.global_batch, t.global_batch))
        loss = cross_entropy(net(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        rates.append(t.global_batch * cfg.data.seq_len / (time.perf_counter() - t0))
    return statistics.median(rates[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    fourd, plain = [], []
    for r in range(a.rounds):
        fourd.append(fourd_round(a.model, a.steps, a.threads))
        plain.append(plain_round(a.model, a.steps, a.threads))
        print(
            f"round {r + 1}: fourd {fourd[-1]:,.0f} tok/s, plain {plain[-1]:,.0f} tok/s", flush=True
        )
    f, p = statistics.median(fourd), statistics.median(plain)
    print(f"median: fourd {f:,.0f} tok/s, plain {p:,.0f} tok/s, ratio {f / p:.3f}")


if __name__ == "__main__":
    main()
