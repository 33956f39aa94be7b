"""Kill trials: SIGKILL a random rank at a random step and phase of a tp=2,pp=2 run (4 ranks), let the
launcher restart and resume it, and check that the final model digest equals an uninterrupted run's.

Phases: "before" a step (--fault.kill-rank/--fault.at-step: at the step's start), "during" a step (killed
from outside at a random moment of it), "after" a step (killed from outside as soon as its metrics row is
written) and "save" (FOURD_FAULT_KILL_IN_SAVE: inside an asynchronous checkpoint save, after the data
files and before the manifest). Restarts within one launch (--max-restarts 1) resume on their own.

    OMP_NUM_THREADS=1 python benchmarks/kill_trials.py --trials 100 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS, INTERVAL, RANKS = 8, 2, 4
BASE = [
    *(
        "train",
        "--model",
        "debug",
        "--layout",
        "tp=2,pp=2",
        "--schedule",
        "1f1b",
        "--microbatches",
        "2",
    ),
    *("--steps", str(STEPS), "--seed", "0", "--train.global_batch=4", "--data.seq_len=64"),
    *(
        "--checkpoint.interval",
        str(INTERVAL),
        "--checkpoint.async_save",
        "true",
        "--max-restarts",
        "1",
    ),
]
# The steps each phase can hit: "during" step 1 would often land in start-up; "after" the last step, in the exit.
STEP_RANGE = {"before": (1, STEPS), "during": (2, STEPS), "after": (1, STEPS - 1)}
PHASES = (*STEP_RANGE, "save")


def fourd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fourd", *args]


def env(extra: dict | None = None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


def digest(run_dir: Path) -> str:
    out = subprocess.run(
        fourd("ckpt", "info", str(run_dir), "--json"), capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode != 0:
        return f"no checkpoint ({out.stderr.strip()})"
    info = json.loads(out.stdout)
    return (
        info["model_digest"]
        if info["step"] == STEPS
        else f"newest checkpoint at step {info['step']}"
    )


def workers(launcher: int) -> list[int]:
    """The launcher's worker processes in local-rank order (the elastic agent starts them in that order)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(stat[1]) == launcher and b"spawn_main" in cmd:
            found.append((int(stat[19]), int(entry.name)))  # start time, pid
    return [pid for _, pid in sorted(found)]


def rows(run_dir: Path) -> int:
    try:
        return sum(1 for line in open(run_dir / "metrics.jsonl") if line.strip())
    except OSError:
        return 0


def kill_from_outside(
    proc: subprocess.Popen, run_dir: Path, rank: int, after_rows: int, delay: float
) -> bool:
    """SIGKILL local rank `rank` once `after_rows` steps are logged, `delay` seconds later."""
    while rows(run_dir) < after_rows:
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    time.sleep(delay)
    pids = workers(proc.pid)
    if len(pids) != RANKS:
        return False
    os.kill(pids[rank], signal.SIGKILL)
    return True


def trial(pick: random.Random, run_dir: Path) -> tuple[str, str, str]:
    """Run one killed job; (what was done, how it restarted, final digest)."""
    phase, rank = pick.choice(PHASES), pick.randrange(RANKS)
    if phase == "save":
        step = pick.randrange(INTERVAL, STEPS + 1, INTERVAL)
    else:
        step = pick.randint(*STEP_RANGE[phase])
    args, extra = [*BASE, "--run-dir", str(run_dir)], {}
    if phase == "before":
        args += ["--fault.kill-rank", str(rank), "--fault.at-step", str(step)]
    elif phase == "save":
        extra["FOURD_FAULT_KILL_IN_SAVE"] = f"{rank}@{step}"
    log = open(run_dir.with_suffix(".log"), "w")
    proc = subprocess.Popen(
        fourd(*args), stdout=log, stderr=subprocess.STDOUT, env=env(extra), cwd=ROOT
    )
    killed = True
    if phase in ("during", "after"):
        # "during": a random moment of step `step` (steps take about 0.2-0.4 s here); "after": at once
        delay = pick.uniform(0.0, 0.25) if phase == "during" else 0.0
        killed = kill_from_outside(
            proc, run_dir, rank, step - 1 if phase == "during" else step, delay
        )
    code = proc.wait(timeout=1800)
    log.close()
    text = run_dir.with_suffix(".log").read_text()
    again = (
        "no checkpoint yet, training again from step 1" in text
    )  # a restart before any checkpoint
    resumed = [
        line.split(" from checkpoint ")[1].split(" at step")[0]
        for line in text.splitlines()
        if "resuming after" in line
    ]
    how = (
        f"restarted, resumed {Path(resumed[0]).name}"
        if resumed
        else "restarted from step 0"
        if again
        else "no restart"
    )
    what = f"kill rank {rank} {phase} step {step}" + (
        "" if killed else " (missed: the run ended first)"
    )
    return (
        what,
        how if code == 0 else f"exit {code}: {text.strip().splitlines()[-1][:120]}",
        digest(run_dir),
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trials", type=int, default=10, help="number of killed runs")
    ap.add_argument(
        "--seed", type=int, default=0, help="draws the rank, step and phase of every trial"
    )
    args = ap.parse_args()
    pick = random.Random(args.seed)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="fourd-kill-") as tmp:
        ref = Path(tmp, "reference")
        subprocess.run(
            fourd(*BASE, "--run-dir", str(ref)),
            capture_output=True,
            env=env(),
            cwd=ROOT,
            check=True,
        )
        want = digest(ref)
        print(
            f"uninterrupted: {STEPS} steps at tp=2,pp=2, checkpoint every {INTERVAL} (async), digest {want[:16]}",
            flush=True,
        )
        same = 0
        for n in range(1, args.trials + 1):
            t = time.time()
            what, how, got = trial(pick, Path(tmp, f"trial-{n}"))
            same += got == want
            verdict = "identical" if got == want else f"DIFFERS ({got[:60]})"
            print(
                f"trial {n}/{args.trials}: {what}: {how}; final digest {verdict} ({time.time() - t:.0f} s)",
                flush=True,
            )
            if got != want:  # the evidence, before the temporary directory goes
                tail = Path(tmp, f"trial-{n}.log").read_text().strip().splitlines()[-8:]
                print("\n".join(f"    {line[:200]}" for line in tail), flush=True)
    wall = time.time() - t0
    print(
        f"{same}/{args.trials} bitwise identical, wall time {wall / 60:.1f} min (seed {args.seed})",
        flush=True,
    )
    return 0 if same == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
