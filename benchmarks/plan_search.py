"""How long `fourd plan --search` takes: the search alone (in process, after imports; wall clock and the
process's CPU time, which other processes on a busy machine disturb less) and the whole command; with
`--anchor`, the anchored commands too (a plan with its layout given, and a search), each a whole process.

    .venv/bin/python benchmarks/plan_search.py [--repeats 5] [--anchor]

The case is the issue's: Llama 3 405B on 16,384 GPUs of llama3-h100, 8K sequences, 16M tokens per step. The
anchor is Llama 3's Table 4 row 1 step on 8,192 GPUs (the validation suite's `llama3-t4-8192`): its plan's
JSON with the published step time. The targets (issues 22 and 23): a search under 1 s, an anchored plan
under 0.5 s and an anchored search under 1 s, whole commands; they are measured here, not in a timed test.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
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
    """A fresh interpreter, so the time model's caches start cold as they do for a user; the ten
    best plans, as `--search` ranks them (fourd.plan.search.rank)."""
    code = (
        "import time\n"
        "from fourd.model.config import get_preset\n"
        "from fourd.plan.cluster import load_cluster\n"
        "from fourd.plan.request import ranking, resolve\n"
        "m, c = get_preset('llama3-405b'), load_cluster('llama3-h100')\n"
        "t0, c0 = time.perf_counter(), time.process_time()\n"
        "found = ranking(resolve(m, c, {'gpus': 16384, 'seq': 8192, 'global_seqs': 2048}), 10)\n"
        "t, cpu = time.perf_counter() - t0, time.process_time() - c0\n"
        "print(t, cpu, found.searched, found.plans[0].mfu)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    t, cpu, n, mfu = out.split()
    return float(t), float(cpu), int(n), float(mfu)


ANCHORED_PLAN = ["--gpus=16384", "--layout=tp=8,pp=16,dp=128", "--microbatches=16", "--json"]
ANCHORED_SEARCH = ["--gpus=16384", "--search", "--json"]


def table_4_anchor() -> dict:
    """The validation suite's Llama 3 Table 4 row 1 (`llama3-t4-8192`): its plan's JSON, which is an
    anchor, with the published step time in place of the predicted one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from validate_planner import predict
    from validation.runs import load

    row = next(run for run in load()[1] if run.id == "llama3-t4-8192")
    return predict(row).to_json() | {"step_time_s": row.step_time_s_derived}


def command_once(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user and system) of one whole `python -m fourd ...` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "fourd", *argv], capture_output=True, check=True, cwd=ROOT
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def report(name: str, times: list[tuple[float, float]]) -> None:
    """One line: the median and fastest wall time of `times` (wall, CPU) and their median CPU time."""
    walls, cpus = [wall for wall, _ in times], [cpu for _, cpu in times]
    print(
        f"  {name}: median {statistics.median(walls):.3f} s, min {min(walls):.3f} s "
        f"(CPU time: median {statistics.median(cpus):.3f} s)"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--anchor", action="store_true", help="time the anchored plan and search too")
    args = p.parse_args()
    runs = [search_once() for _ in range(args.repeats)]
    whole = [command_once(ARGS) for _ in range(args.repeats)]
    searches = [t for t, _, _, _ in runs]
    cpu = [c for _, c, _, _ in runs]
    _, _, n, mfu = runs[0]
    print(f"search of {n:,} configurations, best MFU {mfu:.3f}")
    print(
        f"  search alone:  median {statistics.median(searches):.3f} s, min {min(searches):.3f} s "
        f"(CPU time of the process: median {statistics.median(cpu):.3f} s)"
    )
    report("whole command (interpreter start included)", whole)
    if not args.anchor:
        return
    measured = table_4_anchor()
    with tempfile.TemporaryDirectory() as folder:
        anchor = Path(folder) / "anchor.json"
        anchor.write_text(json.dumps(measured))
        for name, target in (
            ("anchored plan", ANCHORED_PLAN),
            ("anchored search", ANCHORED_SEARCH),
        ):
            argv = ["plan", "--anchor", str(anchor), *target]
            report(f"{name}, whole command", [command_once(argv) for _ in range(args.repeats)])


if __name__ == "__main__":
    main()
