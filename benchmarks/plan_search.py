"""How long `fourd plan --search` takes: the search alone (in process, after imports; wall clock and the
process's CPU time, which other processes on a busy machine disturb less) and the whole command.

    .venv/bin/python benchmarks/plan_search.py [--repeats 5]

The case is the issue's: Llama 3 405B on 16,384 GPUs of llama3-h100, 8K sequences, 16M tokens per step.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "plan",
    "--model",
    "llama3-405b",
    "--cluster",
    "llama3-h100",
    "--gpus",
    "16384",
    "--seq",
    "8192",
    "--global-batch-tokens",
    "16777216",
    "--search",
    "--json",
]


def search_once() -> tuple[float, float, int, float]:
    """A fresh interpreter, so the time model's caches start cold as they do for a user."""
    code = (
        "import time\n"
        "from fourd.model.config import get_preset\n"
        "from fourd.plan.cluster import load_cluster\n"
        "from fourd.plan.request import plans as search, resolve\n"
        "m, c = get_preset('llama3-405b'), load_cluster('llama3-h100')\n"
        "t0, c0 = time.perf_counter(), time.process_time()\n"
        "plans = search(resolve(m, c, {'gpus': 16384, 'seq': 8192, 'global_seqs': 2048}))\n"
        "print(time.perf_counter() - t0, time.process_time() - c0, len(plans), plans[0].mfu)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    t, cpu, n, mfu = out.split()
    return float(t), float(cpu), int(n), float(mfu)


def command_once() -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "fourd", *ARGS], capture_output=True, check=True, cwd=ROOT
    )
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    runs = [search_once() for _ in range(args.repeats)]
    whole = [command_once() for _ in range(args.repeats)]
    searches = [t for t, _, _, _ in runs]
    cpu = [c for _, c, _, _ in runs]
    _, _, n, mfu = runs[0]
    print(f"search of {n:,} configurations, best MFU {mfu:.3f}")
    print(
        f"  search alone:  median {statistics.median(searches):.3f} s, min {min(searches):.3f} s "
        f"(CPU time of the process: median {statistics.median(cpu):.3f} s)"
    )
    print(
        f"  whole command: median {statistics.median(whole):.3f} s, min {min(whole):.3f} s (interpreter start included)"
    )


if __name__ == "__main__":
    main()
