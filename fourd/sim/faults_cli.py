"""Monte-Carlo of interruptions over a long run: unexpected failures per component at the rates of
Llama 3 Table 5 (scaled with the number of GPUs), planned interruptions (47 in 54 days), checkpoint
saves, restarts and the work lost since the last checkpoint; the effective training fraction and the
Young and Daly checkpoint intervals. Assumed times (see docs/simulators.md): checkpoint save 10 s,
restart 5 min; change them with --checkpoint-s and --restart-min.

examples:
  fourd sim faults --gpus 16384 --days 54
  fourd sim faults --gpus 16384 --days 54 --runs 1000 --seed 0 --json
  fourd sim faults --gpus 8192 --days 30 --checkpoint-interval-min 30
"""

from __future__ import annotations

import json

from fourd.sim import faults


def add_arguments(p):
    from fourd.plan.request import bounded

    p.add_argument("--gpus", type=bounded(int, 1, 1 << 24), required=True, help="GPUs in the job")
    p.add_argument("--days", type=bounded(float, 1e-6, 1e6), required=True, help="length of the run in days")
    p.add_argument(
        "--checkpoint-interval-min",
        type=bounded(float, 1e-6, 1e9),
        help="training minutes between checkpoints (default: Daly's optimum)",
    )
    p.add_argument(
        "--checkpoint-s",
        type=bounded(float, 0, 1e9),
        default=faults.CHECKPOINT_S,
        help=f"seconds the job pauses to save a checkpoint (default {faults.CHECKPOINT_S:g})",
    )
    p.add_argument(
        "--restart-min",
        type=bounded(float, 0, 1e9),
        default=faults.RESTART_S / 60,
        help=f"minutes from an interruption to training again (default {faults.RESTART_S / 60:g})",
    )
    p.add_argument(
        "--runs",
        type=bounded(int, 1, 1 << 40),
        default=1000,
        help="Monte-Carlo runs (default 1000; refused beyond what this machine's memory holds)",
    )
    p.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=0, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    interval = None if args.checkpoint_interval_min is None else args.checkpoint_interval_min * 60
    result = faults.simulate(
        args.gpus, args.days, args.runs, args.seed, interval, args.checkpoint_s, args.restart_min * 60
    )
    s = faults.summary(result)
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{s['gpus']:,} GPUs for {s['days']:g} days, {s['runs']} runs (means per run)")
    print(
        f"  unexpected interruptions  {s['unexpected_interruptions']:.1f}  (job MTBF {s['mtbf_h']:.2f} h, "
        f"{100 * s['hardware_share']:.0f} % hardware)"
    )
    print(f"  planned interruptions     {s['planned_interruptions']:.1f}")
    print(
        f"  checkpoint every          {s['checkpoint_interval_min']:.1f} min  (Daly {s['optimal_checkpoint_interval_min']:.1f}, "
        f"Young {s['young_interval_min']:.1f}; save {s['checkpoint_save_s']:g} s, restart {s['restart_s'] / 60:g} min)"
    )
    print(
        f"  time lost                 redone work {s['lost_work_h']:.1f} h, restarts {s['restart_h']:.1f} h, "
        f"checkpointing {s['checkpointing_h']:.1f} h"
    )
    print(
        f"  effective training        {100 * s['effective_training_fraction']:.1f} %  "
        f"(5th-95th percentile {100 * s['effective_training_fraction_p5']:.1f}-{100 * s['effective_training_fraction_p95']:.1f} %)"
    )
    print("  unexpected, by component:")
    for name, n in sorted(s["components"].items(), key=lambda kv: -kv[1]):
        print(f"    {name:<32} {n:7.1f}")
    return 0
