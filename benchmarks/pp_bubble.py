"""Measured GPipe bubble against (p−1)/(m+p−1) (GPipe, Huang et al. 2019).

p gloo processes run fourd's PipelineRunner on the GPipe schedule of fourd.schedules; each rank's
bubble_fraction is 1 − (seconds inside its F and B actions) / (the step's wall seconds). The stages are
compute-heavy so that sends, receives and Python overhead are small next to the matmuls:

    each stage: --layers-per-stage Llama blocks of dim 512, FFN 1536, 8 heads (no GQA), over one
    microbatch of 1 sequence x 256 tokens (about 1.9 GFLOP per block forward); vocabulary 256, so the
    embedding and the output projection are negligible, and no stage holds fewer layers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_bubble.py --p 2 --m 1 2 4 8

Each process computes with one thread: run with p at most the number of free cores, else the ranks
compete for cores in the steady phase but not while the pipeline fills and drains, which is not the
machine the formula describes.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import statistics

SEQ, DIM, FFN, HEADS, VOCAB = 256, 512, 1536, 8, 256


def _rank(rank: int, p: int, port: int, ms: list[int], layers: int, steps: int, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fourd.model.config import ModelConfig
    from fourd.parallel.pp import PipelineRunner, pipeline_split
    from fourd.schedules import build_schedule

    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, p, is_master=rank == 0, timeout=datetime.timedelta(seconds=600)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=p)
    cfg = ModelConfig(
        layers=layers * p, dim=DIM, ffn=FFN, heads=HEADS, kv_heads=HEADS, vocab=VOCAB, max_seq=SEQ
    )
    results = {}
    for m in ms:
        schedule = build_schedule("gpipe", p, m)
        stages = pipeline_split(cfg, rank, schedule, seed=0, fewer_first_last=False)
        runner = PipelineRunner(
            stages,
            schedule,
            dist.group.WORLD,
            lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        )
        tokens = torch.randint(0, VOCAB, (m, SEQ + 1), generator=torch.Generator().manual_seed(0))
        bubbles, walls = [], []
        for step in range(steps + 1):
            runner.step(tokens[:, :-1], tokens[:, 1:])
            for s in stages:
                s.zero_grad(set_to_none=True)
            if step:  # the first step also infers the shapes passed between stages
                bubbles.append(runner.bubble_fraction)
                walls.append(runner.wall)
        f = [r.end - r.start for r in runner.records if r.kind == "F"]
        b = [r.end - r.start for r in runner.records if r.kind == "B"]
        results[m] = (
            statistics.median(bubbles),
            statistics.median(walls),
            statistics.mean(f),
            statistics.mean(b),
        )
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--p", type=int, nargs="+", default=[2], help="pipeline stages (one process each)"
    )
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8], help="microbatches")
    ap.add_argument("--layers-per-stage", type=int, default=2)
    ap.add_argument(
        "--steps", type=int, default=3, help="timed steps per (p, m), after one warm-up step"
    )
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(
        f"GPipe, {args.layers_per_stage} blocks of dim {DIM} / FFN {FFN} per stage, microbatch 1 x {SEQ} tokens, "
        f"median of {args.steps} steps"
    )
    print(
        f"{'p':>3} {'m':>3} {'formula':>8} {'measured':>9} {'diff':>7}   per rank   F ms   B ms  step s"
    )
    for p in args.p:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=_rank, args=(r, p, port, args.m, args.layers_per_stage, args.steps, out)
            )
            for r in range(p)
        ]
        for proc in procs:
            proc.start()
        per_rank = dict(out.get(timeout=1800) for _ in range(p))
        for proc in procs:
            proc.join()
        for m in args.m:
            formula = (p - 1) / (m + p - 1)
            rows = [per_rank[r][m] for r in range(p)]
            measured = statistics.mean(r[0] for r in rows)
            print(
                f"{p:>3} {m:>3} {formula:>8.3f} {measured:>9.3f} {measured - formula:>+7.3f}   "
                f"{' '.join(f'{r[0]:.3f}' for r in rows)}   {1e3 * rows[0][2]:.0f}   {1e3 * rows[0][3]:.0f}"
                f"  {max(r[1] for r in rows):.2f}"
            )


if __name__ == "__main__":
    main()
