"""Simulate one training step event by event: the schedule's action lists with the planner's compute
times, pipeline sends and data-parallel buckets sharing the cluster's links (docs/simulators.md).
Flags as `fourd plan`, settings left out the planner's choice; --search ranks the planner's best
candidates by simulated time.

examples:
  fourd sim step --model llama3-405b --cluster llama3-h100 --gpus 16384 \\
                 --layout tp=8,pp=16,dp=128 --seq 8192 --global-batch-tokens 16M \\
                 --schedule interleaved
  fourd sim step --model llama3-70b --gpus 512 --layout tp=8,pp=4,dp=16 --seq 8192 \\
                 --global-batch-tokens 4M --schedule 1f1b --slow-gpu 40:1.2 --trace step.json
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
        what = f"is in {path.parent}, which is not a folder"
        if path.is_dir():
            what = "is a folder"
        raise BadValue(f"{text[:80]} {what}: give a file path in an existing folder")
    return path


def add_arguments(parser):
    plan_arguments(parser)  # the same model, cluster, layout and run flags as `fourd plan`
    add = parser.add_argument
    add("--no-comm", action="store_true", help="every transfer free: the schedule's figures alone")
    add("--slow-gpu", type=slow_gpu, metavar="RANK:FACTOR", help="GPU RANK is FACTOR times slower")
    add(
        "--diurnal",
        type=bounded(float, 0, 100),
        default=0.0,
        metavar="PCT",
        help="daily clock throttle amplitude in percent (Llama 3 saw 1-2 %%), largest at 15:00",
    )
    add("--hour", type=bounded(float, 0, 24), default=15.0, help="--diurnal's hour (default 15)")
    add("--trace", type=trace_path, metavar="FILE.json", help="a Chrome trace to open in Perfetto")


def diurnal_factor(pct: float, hour: float) -> float:
    """Compute slowdown at `hour`: 1 at 03:00, 1 + pct/100 at 15:00, a cosine between (Llama 3
    §3.3.4)."""
    return 1 + pct / 100 * (1 - math.cos(2 * math.pi * (hour - 3) / 24)) / 2


def report(plan, result, comm: bool, wall: float, train_tokens: float | None = None) -> dict:
    """The `fourd sim step --json` object of one plan's simulated step. MFU = model FLOPs per
    second per GPU / the GPU's peak (Chowdhery et al. 2022, PaLM, appendix B)."""
    config = plan.config
    step = result.step_time_s
    tokens = plan.global_seqs * plan.seq
    tflops = plan.model_flops / step / plan.gpus / 1e12
    out = {
        "step_time_s": step,
        "bubble_fraction": result.bubble_fraction,
        "per_rank_idle_fraction": result.per_rank_idle_fraction,
        "bubble_over_compute": [_over(result.pipeline_span_s, busy) for busy in result.busy_s],
        "tokens_per_s": tokens / step,
        "tflops_per_gpu": tflops,
        "mfu": tflops / plan.peak_tflops,
        "pipeline_span_s": result.pipeline_span_s,
        "optimizer_s": max(result.optimizer_s),
        "comm": comm,
        "planner_step_time_s": plan.step.step_s,
        "planner_vs_sim": plan.step.step_s / step - 1,
        "layout": {dim: getattr(config.layout, dim) for dim in ("tp", "cp", "pp", "dp")},
        "gpus": plan.gpus,
        **{
            key: getattr(config, key)
            for key in (
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


def _over(span: float, busy: float) -> float:
    """The pipeline span's idle time over a rank's compute, (span - busy) / busy; 0 when idle."""
    if not busy:
        return 0.0
    return (span - busy) / busy


def simulate_plan(plan, args, train_tokens: float | None = None):
    """(the StepResult, its report) of the planner's `plan` with the straggler and throttle flags of
    `args`."""
    from fourd.sim.step import simulate_step

    start = time.perf_counter()
    result = simulate_step(
        plan.job, not args.no_comm, args.slow_gpu, diurnal_factor(args.diurnal, args.hour)
    )
    out = report(plan, result, not args.no_comm, time.perf_counter() - start, train_tokens)
    if getattr(args, "anchor", None):  # on the anchor's rate (fourd.plan.anchor)
        from fourd.plan.anchor import anchor_sim

        out = anchor_sim(out, plan)
    return result, out


def _line(row: dict) -> str:
    lay = ",".join(f"{dim}={row['layout'][dim]}" for dim in ("tp", "cp", "pp", "dp"))
    return (
        f"{row['step_time_s']:.4g} s (planner {row['planner_step_time_s']:.4g} s)  {lay} "
        f"{row['schedule']} V={row['virtual_stages']} m={row['microbatches']} ZeRO {row['zero']} "
        f"recompute {row['recompute']}"
    )


def run(args) -> int:
    from fourd.plan.request import plans, resolve_inputs

    if args.anchor:  # the anchor's pinned terms on the planner's times (fourd.plan.anchor)
        from fourd.plan.anchor import anchored_plans

        result = anchored_plans(args)
        req, found = result.request, result.plans
    else:
        req = resolve_inputs(args)
        found = plans(req, top=args.top if args.search else 1)
    if args.search:  # the planner's best candidates that fit, ranked again by simulated step time
        fitting = [candidate for candidate in found if candidate.fits][: args.top] or found[:1]
        rows = sorted(
            (simulate_plan(candidate, args, req.train_tokens)[1] for candidate in fitting),
            key=lambda row: row["step_time_s"],
        )
        if args.json:
            print(json.dumps({"best": rows[0], "candidates": rows}))
        else:
            print("\n".join(f"{i + 1:2}. {_line(row)}" for i, row in enumerate(rows)))
        return 0
    plan = found[0]
    result, out = simulate_plan(plan, args, req.train_tokens)
    if args.trace:
        from fourd.sim.trace import write_trace

        write_trace(result, args.trace)
    if args.json:
        print(json.dumps(out))
        return 0
    print("\n".join(_text(plan, out, args, req.train_tokens)))
    return 0


def _text(plan, out: dict, args, train_tokens: float | None) -> list[str]:
    """The report's lines: the run, then each figure beside its label."""
    config = plan.config
    virtual = ""
    if config.virtual_stages > 1:
        virtual = f" V={config.virtual_stages}"
    free = ""
    if not out["comm"]:
        free = ", transfers free"
    idle = " ".join(f"{100 * x:.1f}" for x in out["per_rank_idle_fraction"])
    lines = [
        f"{plan.gpus:,} GPUs, layout {config.layout}, {config.schedule}{virtual}, "
        f"{plural(config.microbatches, 'microbatch')} of {plan.micro_seqs} x {plan.seq} tokens, "
        f"ZeRO {config.zero}, recompute {config.recompute}{free}",
        f"  step time        {out['step_time_s']:.4g} s   (planner "
        f"{out['planner_step_time_s']:.4g} s)",
        f"  throughput       {out['tokens_per_s']:,.0f} tokens/s, {out['tflops_per_gpu']:.0f} "
        f"TFLOP/s per GPU, MFU {100 * out['mfu']:.1f} %",
        f"  bubble           {100 * out['bubble_fraction']:.1f} % of the pipeline span "
        f"({out['pipeline_span_s']:.4g} s) on the busiest rank",
        f"  idle per rank    {idle}  (% of the step)",
    ]
    if args.slow_gpu:
        lines.append(f"  straggler        GPU {args.slow_gpu[0]} at {args.slow_gpu[1]:g}x")
    if train_tokens:
        days = out["training_days"]
        lines.append(f"  training         {days:.1f} days for {train_tokens:.3g} tokens")
    if args.trace:
        lines.append(f"  trace            {args.trace} (open in Perfetto)")
    lines.append(f"  simulated in     {out['sim_wall_s']:.2f} s, {out['transfers']} transfers")
    return lines
