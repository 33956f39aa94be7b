"""The planner against measurement: `fourd train` step times on this machine for several layouts
(1 to 8 ranks), next to what `fourd plan --cluster local` predicts for the same run.

    fourd calibrate                     # writes $FOURD_HOME/clusters/local.toml (once, when the machine is quiet)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_vs_measured.py [--model small] [--steps 8]

Each layout trains `--steps` steps in a fresh run directory; the first `--warmup` steps (start-up,
allocator and thread-pool warm-up) are dropped and the median of the rest is the measured step time.
Prints a markdown table and the median absolute error; also each layout's step time relative to the first
layout's (1 rank), measured and predicted, which other load on a shared machine disturbs less.
`--rounds N` runs every layout N times, in turn (all layouts, then all again), and takes each layout's
median over the rounds, so that a machine whose speed drifts over minutes slows every layout alike; the
table gives the rounds' range beside the median. `--save FILE` keeps the measured step times (JSON);
`--measured FILE` predicts against them again without training, e.g. after recalibrating. `--anchor`
anchors every prediction on the first layout's run (the 1-rank run's anchor.json, with its median step
time: `fourd plan --anchor`, fourd.plan.anchor) and judges the other layouts, what an anchored
prediction is for: the multi-rank layouts from a 1-rank step.
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

ROOT = Path(__file__).resolve().parents[1]
FOURD = [sys.executable, "-m", "fourd"]
# (layout, schedule, microbatches): 1 to 8 ranks, every dimension alone and combined
LAYOUTS = [
    ("dp=1", "1f1b", 1),
    ("dp=2", "1f1b", 1),
    ("tp=2", "1f1b", 1),
    ("cp=2", "1f1b", 1),
    ("pp=2", "1f1b", 4),
    ("tp=2,dp=2", "1f1b", 1),
    ("pp=2,dp=2", "gpipe", 4),
    ("tp=2,pp=2,dp=2", "1f1b", 4),
]


def measure(model: str, layout: str, schedule: str, m: int, args) -> tuple[float, dict]:
    """(the median step time after the warm-up, the run's anchor.json with that median)."""
    with tempfile.TemporaryDirectory(prefix="fourd-pvm-") as run_dir:
        cmd = [
            *FOURD,
            "train",
            "--model",
            model,
            "--layout",
            layout,
            "--schedule",
            schedule,
            "--microbatches",
            str(m),
            "--steps",
            str(args.steps),
            "--seed",
            "0",
            "--run-dir",
            run_dir,
            f"--train.global_batch={args.global_batch}",
            f"--data.seq_len={args.seq}",
            f"--parallel.zero={args.zero}",
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=args.timeout
        )
        if r.returncode:
            raise RuntimeError(
                f"{' '.join(cmd[2:])} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
            )
        rows = [
            json.loads(line)
            for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        anchor = json.loads(Path(run_dir, "anchor.json").read_text())
    times = [row["step_time_s"] for row in rows[args.warmup :]]
    if not times:
        raise RuntimeError(
            f"{layout}: no steps after the {args.warmup} warm-up steps; raise --steps"
        )
    return statistics.median(times), anchor | {"step_time_s": statistics.median(times)}


def predict(model: str, layout: str, schedule: str, m: int, args, anchor: str = "") -> dict:
    cmd = [
        *FOURD,
        "plan",
        *(["--anchor", anchor] if anchor else []),
        "--model",
        model,
        "--cluster",
        args.cluster,
        "--layout",
        layout,
        "--schedule",
        schedule,
        "--microbatches",
        str(m),
        "--seq",
        str(args.seq),
        "--global-batch-tokens",
        str(args.global_batch * args.seq),
        "--zero",
        str(args.zero),
        "--recompute",
        "none",
        "--json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    if r.returncode:
        raise RuntimeError(f"fourd plan failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def median_round(runs: list[tuple[float, dict]]) -> tuple[float, list[float], dict]:
    """Of one layout's rounds, each (step time, anchor.json): the median step time, every round's
    time in order, and the anchor.json of the round nearest that median, its step time the
    median."""
    times = [seconds for seconds, _ in runs]
    median = statistics.median(times)
    nearest = min(runs, key=lambda run: abs(run[0] - median))[1]
    return median, times, nearest | {"step_time_s": median}


def measure_rounds(chosen: list[tuple], keys: dict, saved: dict, args) -> None:
    """Train every chosen layout `args.rounds` times, in turn, into `saved`: per layout its median
    step time (key), the rounds' times ("KEY rounds") and the anchor.json of its median round
    ("KEY anchor"); written to `args.save` after every run, so an interrupted sweep keeps what ran."""
    runs: dict[str, list[tuple[float, dict]]] = {}
    for _ in range(args.rounds):
        for layout, schedule, m in chosen:
            key = keys[layout, schedule, m]
            runs.setdefault(key, []).append(measure(args.model, layout, schedule, m, args))
            median, times, anchor = median_round(runs[key])
            print(f"round {len(times)}: {layout} {times[-1]:.3f} s", file=sys.stderr, flush=True)
            saved[key] = median
            saved[f"{key} rounds"] = times
            saved[f"{key} anchor"] = anchor
            if args.save:
                Path(args.save).write_text(json.dumps(saved, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="small")
    p.add_argument(
        "--cluster",
        default="local",
        help="profile name or path (default local, from fourd calibrate)",
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    p.add_argument(
        "--zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage (default 2)"
    )
    p.add_argument("--only", help="layouts to run, separated by semicolons, e.g. 'dp=2;tp=2,dp=2'")
    p.add_argument("--timeout", type=int, default=600, help="seconds per training run")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times every layout is run, in turn; each layout's median is kept (default 1)",
    )
    p.add_argument("--save", help="write the measured step times to this JSON file")
    p.add_argument(
        "--measured", help="take the measured step times from a --save file instead of training"
    )
    p.add_argument(
        "--anchor", action="store_true", help="anchor the predictions on the first layout's run"
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give 1 or more")
    chosen = [row for row in LAYOUTS if not args.only or row[0] in args.only.split(";")]
    print(
        f"{args.model}, {args.global_batch} × {args.seq} tokens per step, ZeRO {args.zero}, "
        f"{time.strftime('%Y-%m-%d')}, cluster profile {args.cluster}\n"
    )
    keys = {
        row: f"{args.model} {row[0]} {row[1]} m={row[2]} seq={args.seq} "
        f"batch={args.global_batch} zero{args.zero}"
        for row in chosen
    }
    saved = json.loads(Path(args.measured).read_text()) if args.measured else {}
    if not args.measured:
        measure_rounds(chosen, keys, saved, args)
    print(
        "| layout | schedule | m | measured s | predicted s | error | measured / first | predicted / first |"
    )
    print("|---|---|---|---|---|---|---|---|")
    errors, relative, first = [], [], None
    anchor_file = Path(tempfile.mkdtemp(prefix="fourd-pvm-anchor-")) / "anchor.json"
    for layout, schedule, m in chosen:
        key = keys[layout, schedule, m]
        if key not in saved:
            continue
        measured = saved[key]
        rounds = saved.get(f"{key} rounds", [])
        spread = f" ({min(rounds):.3f}-{max(rounds):.3f})" if len(rounds) > 1 else ""
        if args.anchor and first is None:  # the first layout's run anchors the rest
            anchor_file.write_text(json.dumps(saved[f"{key} anchor"]))
        anchored = str(anchor_file) if args.anchor else ""
        predicted = predict(args.model, layout, schedule, m, args, anchored)["step_time_s"]
        err = predicted / measured - 1
        if first is not None or not args.anchor:  # anchored, the first is its own measurement
            errors.append(abs(err))
        first = first or (measured, predicted)
        rel_m, rel_p = measured / first[0], predicted / first[1]
        relative.append(abs(rel_p / rel_m - 1))
        print(
            f"| {layout} | {schedule} | {m} | {measured:.3f}{spread} | {predicted:.3f} | {100 * err:+.0f} % | "
            f"{rel_m:.2f} | {rel_p:.2f} |",
            flush=True,
        )
    worst = max(errors, default=0.0)
    print(
        f"\nmedian absolute error {100 * statistics.median(errors):.0f} % (worst {100 * worst:.0f} %) "
        f"over {len(errors)} layouts{', anchored on the first' if args.anchor else ''}; "
        f"of the step times relative to the first layout's: {100 * statistics.median(relative[1:] or [0]):.0f} %"
    )


if __name__ == "__main__":
    main()
