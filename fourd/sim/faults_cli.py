"""Monte-Carlo of interruptions over a long run at Llama 3 Table 5's rates (scaled with the GPUs):
checkpoints, restarts and lost work; the effective training fraction and the Young and Daly
checkpoint intervals. Assumed times (docs/simulators.md): checkpoint save 10 s, restart 5 min
(--checkpoint-s, --restart-min).

examples:
  fourd sim faults --gpus 16384 --days 54
  fourd sim faults --gpus 16384 --days 54 --runs 1000 --seed 0 --json
  fourd sim faults --gpus 8192 --days 30 --checkpoint-interval-min 30
"""

from __future__ import annotations

import json

from fourd.plan.request import bounded
from fourd.sim import faults


def add_arguments(parser):
    flags = (
        ("--gpus", bounded(int, 1, 1 << 24), None, "GPUs in the job"),
        ("--days", bounded(float, 1e-6, 1e6), None, "length of the run in days"),
        (
            "--checkpoint-interval-min",
            bounded(float, 1e-6, 1e9),
            None,
            "training minutes between checkpoints (default: Daly's optimum)",
        ),
        (
            "--checkpoint-s",
            bounded(float, 0, 1e9),
            faults.CHECKPOINT_S,
            f"seconds a checkpoint save pauses the job (default {faults.CHECKPOINT_S:g})",
        ),
        (
            "--restart-min",
            bounded(float, 0, 1e9),
            faults.RESTART_S / 60,
            f"minutes from an interruption to training again (default {faults.RESTART_S / 60:g})",
        ),
        (
            "--runs",
            bounded(int, 1, 1 << 40),
            1000,
            "Monte-Carlo runs (default 1000; refused beyond this machine's memory)",
        ),
        ("--seed", bounded(int, 0, 2**63 - 1), 0, "random seed (default 0)"),
    )
    for flag, parse, default, text in flags:
        parser.add_argument(
            flag, type=parse, default=default, required=flag in ("--gpus", "--days"), help=text
        )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    interval = None
    if args.checkpoint_interval_min is not None:
        interval = args.checkpoint_interval_min * 60
    result = faults.simulate(
        args.gpus,
        args.days,
        args.runs,
        args.seed,
        interval_s=interval,
        checkpoint_s=args.checkpoint_s,
        restart_s=args.restart_min * 60,
    )
    figures = faults.summary(result)
    if args.json:
        print(json.dumps(figures))
        return 0
    print("\n".join(_report(figures)))
    for name, count in sorted(figures["components"].items(), key=lambda item: -item[1]):
        print(f"    {name:<32} {count:7.1f}")
    return 0


def _report(figures: dict) -> list[str]:
    """The report's lines above the per-component counts: each figure beside its label."""
    fig = figures
    hardware_pct = 100 * fig["hardware_share"]
    effective_pct = 100 * fig["effective_training_fraction"]
    p5_pct = 100 * fig["effective_training_fraction_p5"]
    p95_pct = 100 * fig["effective_training_fraction_p95"]
    label = "{:<26}".format
    return [
        f"{fig['gpus']:,} GPUs for {fig['days']:g} days, {fig['runs']} runs (means per run)",
        f"  {label('unexpected interruptions')}{fig['unexpected_interruptions']:.1f}"
        f"  (job MTBF {fig['mtbf_h']:.2f} h, {hardware_pct:.0f} % hardware)",
        f"  {label('planned interruptions')}{fig['planned_interruptions']:.1f}",
        f"  {label('checkpoint every')}{fig['checkpoint_interval_min']:.1f} min"
        f"  (Daly {fig['optimal_checkpoint_interval_min']:.1f},"
        f" Young {fig['young_interval_min']:.1f};"
        f" save {fig['checkpoint_save_s']:g} s, restart {fig['restart_s'] / 60:g} min)",
        f"  {label('time lost')}redone work {fig['lost_work_h']:.1f} h,"
        f" restarts {fig['restart_h']:.1f} h, checkpointing {fig['checkpointing_h']:.1f} h",
        f"  {label('effective training')}{effective_pct:.1f} %"
        f"  (5th-95th percentile {p5_pct:.1f}-{p95_pct:.1f} %)",
        "  unexpected, by component:",
    ]
