"""`fourd sim step`: how long a simulated step takes to compute, and how the simulated step time compares
with the planner's on the Llama 3 Table 4 layouts (the planner's choice of V, m, ZeRO, recomputation).

    .venv/bin/python benchmarks/sim_step.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

from fourd.layout import parse_layout
from fourd.model.config import get_preset
from fourd.plan.cluster import load_cluster
from fourd.plan.request import best_plan
from fourd.sim.step import simulate_step

ROWS = [("tp=8,pp=16,dp=64", 8192), ("tp=8,pp=16,dp=128", 8192), ("tp=8,cp=16,pp=16,dp=8", 131072)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="simulations per row; the fastest counts")
    args = ap.parse_args()
    model, cluster = get_preset("llama3-405b"), load_cluster("llama3-h100")
    print(
        "| GPUs | layout | seq | schedule | V | m | ZeRO | recompute | sim step s | planner s | sim − planner | "
        "sim MFU | wall s | transfers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for text, seq in ROWS:
        layout = parse_layout(text)
        for schedule in ("interleaved", "1f1b"):
            plan = best_plan(
                model,
                cluster,
                layout.world,
                seq,
                2**24 // seq,
                {"layout": layout, "schedule": schedule},
            )
            c = plan.config
            best = float("inf")
            for _ in range(args.repeat):
                start = time.perf_counter()
                r = simulate_step(plan.job)
                best = min(best, time.perf_counter() - start)
            mfu = plan.model_flops / r.step_time_s / layout.world / 1e12 / cluster.gpu.peak_tflops
            print(
                f"| {layout.world:,} | {text} | {seq:,} | {c.schedule} | {c.virtual_stages} | {c.microbatches} | {c.zero} "
                f"| {c.recompute} | {r.step_time_s:.3f} | {plan.step.step_s:.3f} | "
                f"{100 * (r.step_time_s / plan.step.step_s - 1):+.1f} % | {100 * mfu:.1f} % | {best:.2f} | {len(r.transfers)} |"
            )


if __name__ == "__main__":
    main()
