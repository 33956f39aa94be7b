"""`fourd sim faults`: time for Monte-Carlo runs of 54 days on 16,384 GPUs, and the effective training
fraction against the checkpoint interval (Daly's optimum and 0.5x, 1.5x of it).

    .venv/bin/python benchmarks/sim_faults.py [--runs 1000]
"""

from __future__ import annotations

import argparse
import time

from fourd.sim import faults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    args = ap.parse_args()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        s = faults.summary(faults.simulate(16384, 54, runs=args.runs, seed=0))
        best = min(best, time.perf_counter() - start)
    print(
        f"{args.runs} runs x 54 days on 16,384 GPUs: {best:.3f} s (fastest of 3); unexpected "
        f"{s['unexpected_interruptions']:.1f}, planned {s['planned_interruptions']:.1f}, effective "
        f"{100 * s['effective_training_fraction']:.2f} %, Daly {s['optimal_checkpoint_interval_min']:.2f} min, "
        f"Young {s['young_interval_min']:.2f} min"
    )
    daly = faults.daly_interval(faults.CHECKPOINT_S, faults.mtbf_s(16384))
    print("| interval | minutes | effective training |")
    print("|---|---|---|")
    for k in (0.25, 0.5, 1.0, 1.5, 2.0, 4.0):
        eff = faults.simulate(
            16384, 54, runs=args.runs, seed=0, interval_s=k * daly
        ).effective.mean()
        print(f"| {k:g} x Daly | {k * daly / 60:.1f} | {100 * eff:.2f} % |")


if __name__ == "__main__":
    main()
