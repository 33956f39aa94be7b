"""Simulate one training step event by event: the schedule's action lists with the planner's compute
times, pipeline sends and data-parallel buckets sharing the cluster's links (docs/simulators.md).
Flags as `fourd plan`, settings left out the planner's choice; --search ranks the planner's best
candidates by simulated time.

examples:
  fourd sim step --model llama3-405b --cluster llama3-h100 --gpus 16384 --layout tp=8,pp=16,dp=128
  \\
                 --seq 8192 --global-batch-tokens 16M --schedule interleaved
  fourd sim step --model llama3-70b --gpus 512 --layout tp=8,pp=4,dp=16 --seq 8192
  --global-batch-tokens 4M \\
                 --schedule 1f1b --slow-gpu 40:1.2 --trace step.json
  fourd sim step --model llama3-8b --gpus 64 --seq 8192 --global-batch-tokens 1M --search --top 5
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from fourd.errors import plural
from fourd.plan.request import BadValue, bounded
from fourd.plan.request import add_arguments as plan_arguments


def slow_gpu(text: str) -> tuple[int, float]:
    """RANK:FACTOR, e.g. 37:1.25 (GPU 37 computes 25 % slower)."""
    rank, _, factor = str(text).partition(":")
    try:
        return bounded(int, 0, 1 << 20)(rank), bounded(float, 1e-3, 1e3)(factor)
    except BadValue as e:
        raise BadValue(
            f"{str(text)[:40]!r} ({e}): write RANK:FACTOR, e.g. 37:1.25 for GPU 37 25 % slower"
        ) from None


def trace_path(text: str) -> Path:
    """A file to write, in a folder that exists."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        what = "is a folder" if path.is_dir() else f"is in {path.parent}, which is not a folder"
        raise BadValue(f"{text[:80]} {what}: give a file path in an existing folder")
    return path


def add_arguments(p):
    plan_arguments(p)  # the same model, cluster, layout and run flags as `fourd plan`
    p.add_argument(
        "--no-comm", action="store_true", help="every transfer free: the schedule's figures alone"
    )
    p.add_argument(
        "--slow-gpu",
        type=slow_gpu,
        metavar="RANK:FACTOR",
        help="GPU RANK computes FACTOR times slower",
    )
    p.add_argument(
        "--diurnal",
        type=bounded(float, 0, 100),
        default=0.0,
        metavar="PCT",
        help="daily clock throttle amplitude in percent (Llama 3 saw 1-2 %%), largest at 15:00",
    )
    p.add_argument(
        "--hour",
        type=bounded(float, 0, 24),
        default=15.0,
        help="time of day for --diurnal (default 15)",
    )
    p.add_argument(
        "--trace",
        type=trace_path,
        metavar="FILE.json",
        help="write a Chrome trace (open it in Perfetto)",
    )


def diurnal_factor(pct: float, hour: float) -> float:
    """Compute slowdown at `hour`: 1 at 03:00, 1 + pct/100 at 15:00, a cosine between (Llama 3
    §3.3.4)."""
    return 1 + pct / 100 * (1 - math.cos(2 * math.pi * (hour - 3) / 24)) / 2


def report(plan, result, comm: bool, wall: float, train_tokens: float | None = None) -> dict:
    c, step, tokens = plan.config, result.step_time_s, plan.global_seqs * plan.seq
    tflops = plan.model_flops / step / plan.gpus / 1e12
    out = {
        "step_time_s": step,
        "bubble_fraction": result.bubble_fraction,
        "per_rank_idle_fraction": result.per_rank_idle_fraction,
        "bubble_over_compute": [
            (result.pipeline_span_s - b) / b if b else 0.0 for b in result.busy_s
        ],
        "tokens_per_s": tokens / step,
        "tflops_per_gpu": tflops,
        "mfu": tflops / plan.cluster.gpu.peak_tflops,
        "pipeline_span_s": result.pipeline_span_s,
        "optimizer_s": max(result.optimizer_s),
        "comm": comm,
        "planner_step_time_s": plan.step.step_s,
        "planner_vs_sim": plan.step.step_s / step - 1,
        "layout": {d: getattr(c.layout, d) for d in ("tp", "cp", "pp", "dp")},
        "gpus": plan.gpus,
        **{
            k: getattr(c, k)
            for k in (
                "schedule",
                "microbatches",
                "virtual_stages",
                "zero",
                "recompute",
                "sequence_parallel",
            )
        },
        "micro_batch_seqs": plan.micro_seqs,
        "seq": plan.seq,
        "global_batch_tokens": tokens,
        "cluster": plan.cluster.name,
        "transfers": len(result.transfers),
        "sim_wall_s": wall,
    }
    if train_tokens:
        out |= {"train_tokens": train_tokens, "training_days": train_tokens * step / tokens / 86400}
    return out


def simulate_plan(plan, args, train_tokens: float | None = None):
    """(the StepResult, its report) of the planner's `plan` with the straggler and throttle flags of
    `args`."""
    from fourd.sim.step import simulate_step

    start = time.perf_counter()
    result = simulate_step(
        plan.job, not args.no_comm, args.slow_gpu, diurnal_factor(args.diurnal, args.hour)
    )
    return result, report(plan, result, not args.no_comm, time.perf_counter() - start, train_tokens)


def _line(r: dict) -> str:
    lay = ",".join(f"{d}={r['layout'][d]}" for d in ("tp", "cp", "pp", "dp"))
    return (
        f"{r['step_time_s']:.4g} s (planner {r['planner_step_time_s']:.4g} s)  {lay} "
        f"{r['schedule']} V={r['virtual_stages']} m={r['microbatches']} ZeRO {r['zero']} "
        f"recompute {r['recompute']}"
    )


def run(args) -> int:
    from fourd.plan.request import plans, resolve_inputs

    req = resolve_inputs(args)
    found = plans(req)
    if args.search:  # the planner's best candidates that fit, ranked again by simulated step time
        fitting = [p for p in found if p.fits][: args.top] or found[:1]
        rows = sorted(
            (simulate_plan(p, args, req.train_tokens)[1] for p in fitting),
            key=lambda r: r["step_time_s"],
        )
        out = {"best": rows[0], "candidates": rows}
        print(
            json.dumps(out)
            if args.json
            else "\n".join(f"{i + 1:2}. {_line(r)}" for i, r in enumerate(rows))
        )
        return 0
    plan, c = found[0], found[0].config
    result, out = simulate_plan(plan, args, req.train_tokens)
    if args.trace:
        from fourd.sim.trace import write_trace

        write_trace(result, args.trace)
    if args.json:
        print(json.dumps(out))
        return 0
    v = f" V={c.virtual_stages}" if c.virtual_stages > 1 else ""
    idle = " ".join(f"{100 * x:.1f}" for x in out["per_rank_idle_fraction"])
    lines = [
        f"{plan.gpus:,} GPUs, layout {c.layout}, {c.schedule}{v}, "
        f"{plural(c.microbatches, 'microbatch')} of {plan.micro_seqs} x {plan.seq} tokens, ZeRO "
        f"{c.zero}, recompute {c.recompute}{'' if out['comm'] else ', transfers free'}",
        f"  step time        {out['step_time_s']:.4g} s   (planner "
        f"{out['planner_step_time_s']:.4g} s)",
        f"  throughput       {out['tokens_per_s']:,.0f} tokens/s, {out['tflops_per_gpu']:.0f} "
        f"TFLOP/s per GPU, MFU {100 * out['mfu']:.1f} %",
        f"  bubble           {100 * out['bubble_fraction']:.1f} % of the pipeline span "
        f"({out['pipeline_span_s']:.4g} s) on the busiest rank",
        f"  idle per rank    {idle}  (% of the step)",
        *(
            [f"  straggler        GPU {args.slow_gpu[0]} at {args.slow_gpu[1]:g}x"]
            if args.slow_gpu
            else []
        ),
        *(
            [
                f"  training         {out['training_days']:.1f} days for "
                f"{req.train_tokens:.3g} tokens"
            ]
            if req.train_tokens
            else []
        ),
        *([f"  trace            {args.trace} (open in Perfetto)"] if args.trace else []),
        f"  simulated in     {out['sim_wall_s']:.2f} s, {out['transfers']} transfers",
    ]
    print("\n".join(lines))
    return 0
