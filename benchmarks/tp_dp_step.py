"""Training step time and per-rank bytes of TP and DP on gloo (CPU, FP32), `small` model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tp_dp_step.py

Each configuration runs on 2 ranks (1 thread each) for 1 warm-up step and 4 timed AdamW steps on 8 sequences
of 256 tokens; it prints the median step time and the bytes rank 0 holds for parameters, gradients and Adam
moments after a step. "1 rank" is the same work on one process with 1 thread.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from dist_util import run_ranks  # noqa: E402

from fourd.layout import Layout  # noqa: E402
from fourd.model.config import get_preset  # noqa: E402
from fourd.model.llama import build_model  # noqa: E402
from fourd.parallel.dp import ShardedAdamW, apply_dp, held_bytes  # noqa: E402
from fourd.parallel.grad import clip_grad_norm  # noqa: E402
from fourd.parallel.mesh import build_mesh, dp_cp_mesh  # noqa: E402
from fourd.parallel.tp import apply_tp, loss_fn  # noqa: E402
from fourd.train.step import param_groups  # noqa: E402

CFG = get_preset("small")
BATCH, SEQ, STEPS = 8, 256, 5
CONFIGS = [("tp=2", dict(tp=2)), ("tp=2 + SP", dict(tp=2, sp=True))] + [
    (f"dp=2 ZeRO {z}", dict(dp=2, zero=z)) for z in (0, 1, 2, 3)
]


def _run(tp=1, dp=1, sp=False, zero=None):
    model = build_model(CFG, seed=0)
    rank = 0
    if tp * dp > 1:
        mesh = build_mesh(Layout(tp=tp, dp=dp))
        apply_tp(model, mesh["tp"], sequence_parallel=sp)
        if dp > 1:
            apply_dp(model, dp_cp_mesh(mesh), zero)
            rank = mesh.get_local_rank("dp")
    else:
        mesh = None
    groups = param_groups(
        [model], 0.1
    )  # as the trainer: norm weights apart (plain tensors under TP without SP)
    if zero == 1:
        opt = ShardedAdamW(groups, dp_cp_mesh(mesh), lr=1e-3, foreach=True)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-3, foreach=True)
    tokens = torch.randint(
        0, CFG.vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    per = BATCH // dp
    x, y = tokens[rank * per : (rank + 1) * per, :-1], tokens[rank * per : (rank + 1) * per, 1:]
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        clip_grad_norm(model.parameters(), 1.0, mesh)
        opt.step()
        times.append(time.perf_counter() - t0)
    moments = [
        v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
    ]
    held = (
        held_bytes(model.parameters())
        + held_bytes(p.grad for p in model.parameters())
        + held_bytes(moments)
    )
    return statistics.median(times[1:]), held


def _ranked(rank, world, kw):
    return _run(**kw)


def main():
    torch.set_num_threads(1)
    base, base_bytes = _run()
    print(
        f"small model ({CFG.params() / 1e6:.2f} M parameters), {BATCH} x {SEQ} tokens per step, FP32, gloo"
    )
    print("| layout | step s | vs 1 rank | MB per rank (params + grads + Adam) |")
    print("|---|---|---|---|")
    print(f"| 1 rank | {base:.3f} | 1.00 | {base_bytes / 1e6:.1f} |")
    for name, kw in CONFIGS:
        step, held = run_ranks(_ranked, 2, kw, timeout=600)[0]
        print(f"| {name} | {step:.3f} | {base / step:.2f} | {held / 1e6:.1f} |")


if __name__ == "__main__":
    main()
