"""fourd's ring all-reduce against the backend's all_reduce: `fourd bench comm --json` for both, for
2 and 4 ranks, and the ring's busbw as a fraction of all_reduce's at each size.

    python benchmarks/comm_ring.py                    # default sweep (1K..64M on CPU), 2 and 4 ranks
    python benchmarks/comm_ring.py --nproc 4 --rounds 3 --max-bytes 64M

--rounds R alternates all_reduce and ring R times and keeps each size's median row over rounds,
so that a burst of other work on a shared machine hits both sides alike. Prints the JSON rows and
a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def bench(op: str, nproc: int, max_bytes: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "fourd",
        "bench",
        "comm",
        "--op",
        op,
        "--nproc",
        str(nproc),
        "--max-bytes",
        max_bytes,
        "--json",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    if done.returncode:
        sys.exit(done.stderr)
    return json.loads(done.stdout)


def median_rows(runs: list[list[dict]]) -> list[dict]:
    return [sorted(rows, key=lambda r: r["time_s"])[len(rows) // 2] for rows in zip(*runs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-bytes", default="64M")
    args = ap.parse_args()
    for n in args.nproc:
        runs = {"all_reduce": [], "ring": []}
        for _ in range(args.rounds):
            for op in runs:
                runs[op].append(bench(op, n, args.max_bytes))
        ar, ring = median_rows(runs["all_reduce"]), median_rows(runs["ring"])
        print(f"\n### {n} ranks\n\n```json")
        for r in ar + ring:
            print(
                json.dumps({k: (round(v, 9) if isinstance(v, float) else v) for k, v in r.items()})
            )
        print(
            "```\n\n| bytes | all_reduce us | busbw GB/s | ring us | busbw GB/s | ring / all_reduce |\n|---|---|---|---|---|---|"
        )
        for a, r in zip(ar, ring):
            print(
                f"| {a['bytes']:,} | {a['time_s'] * 1e6:,.0f} | {a['busbw_gbps']:.3f} | {r['time_s'] * 1e6:,.0f} | "
                f"{r['busbw_gbps']:.3f} | {r['busbw_gbps'] / a['busbw_gbps']:.2f} |"
            )
        big = ar[-1]["bytes"]
        print(
            f"\nring / all_reduce busbw at {big:,} B, {n} ranks: "
            f"{ring[-1]['busbw_gbps'] / ar[-1]['busbw_gbps']:.2f} (medians of {args.rounds} rounds: "
            f"{statistics.median(r[-1]['time_s'] for r in runs['ring']) * 1e3:.1f} ms vs "
            f"{statistics.median(r[-1]['time_s'] for r in runs['all_reduce']) * 1e3:.1f} ms)"
        )


if __name__ == "__main__":
    main()
