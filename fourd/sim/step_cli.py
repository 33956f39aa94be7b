"""Simulate one training step event by event: each pipeline rank runs the schedule's action lists
(fourd.schedules) with compute times from the planner's cost model, activations and gradients move
between stages, and data-parallel buckets are reduced and gathered, all sharing the links of the
cluster's topology. Takes the same model, cluster and layout flags as `fourd plan`; settings left
out are the planner's choice. Identical data-parallel replicas are simulated once, so a 16,384-GPU
step takes well under a second (docs/simulators.md says what that assumes). With --search it
simulates the planner's best candidates and ranks them by simulated step time.

examples:
  fourd sim step --model llama3-405b --cluster llama3-h100 --gpus 16384 --layout tp=8,pp=16,dp=128 \\
                 --seq 8192 --global-batch-tokens 16M --schedule interleaved
  fourd sim step --model-spec layers=128,dim=4096,ffn=16384,heads=32,kv_heads=32,vocab=32000,mlp=gelu \\
                 --gpus 16 --layout pp=16 --schedule gpipe --microbatches 16 --seq 2048 \\
                 --global-batch-tokens 32768 --no-comm --json
  fourd sim step --model llama3-70b --gpus 512 --layout tp=8,pp=4,dp=16 --seq 8192 --global-batch-tokens 4M \\
                 --schedule 1f1b --slow-gpu 40:1.2 --trace step.json
  fourd sim step --model llama3-8b --gpus 64 --seq 8192 --global-batch-tokens 1M --search --top 5
"""

from __future__ import annotations

import json
import math
import time

from fourd.errors import FourdError


def add_arguments(p):
    from fourd.plan import cli as plan_cli

    plan_cli.add_arguments(p)  # the same model, cluster, layout and run flags as `fourd plan`
    p.add_argument("--no-comm", action="store_true", help="every transfer free: the schedule's figures alone")
    p.add_argument("--slow-gpu", metavar="RANK:FACTOR", help="GPU RANK computes FACTOR times slower, e.g. 37:1.25")
    p.add_argument(
        "--diurnal",
        type=float,
        default=0.0,
        metavar="PCT",
        help="daily clock throttle amplitude in percent (Llama 3 saw 1-2 %%), largest at 15:00",
    )
    p.add_argument("--hour", type=float, default=15.0, help="time of day for --diurnal, 0-24 (default 15)")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (open it in Perfetto)")


def diurnal_factor(pct: float, hour: float) -> float:
    """Compute slowdown at `hour`: 1 at 03:00, 1 + pct/100 at 15:00, a cosine between (Llama 3 §3.3.4
    reports a 1-2 % throughput swing with the time of day, from GPU clocks at mid-day temperatures)."""
    return 1 + pct / 100 * (1 - math.cos(2 * math.pi * (hour - 3) / 24)) / 2


def _slow(text: str | None):
    if not text:
        return None
    rank, sep, factor = text.partition(":")
    try:
        return int(rank), float(factor)
    except ValueError:
        raise FourdError(
            f"--slow-gpu {text!r}: write RANK:FACTOR, e.g. 37:1.25 for GPU 37 computing 25 % slower"
        ) from None


def resolve(args):
    """The planner's Plans for these flags, best first (what the user left open, the planner chooses)."""
    from fourd.plan.cli import resolve_inputs
    from fourd.plan.search import search

    i = resolve_inputs(args)
    model, cluster, seq, layout, gpus = i.model, i.cluster, i.seq, i.layout, i.gpus
    schedule = args.schedule or ("interleaved" if (args.virtual_stages or 1) > 1 else None)
    plans = search(
        model,
        cluster,
        gpus,
        seq,
        i.global_seqs,
        recompute=args.recompute,
        layout=layout,
        schedule=schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        zero=args.zero,
        sequence_parallel=i.sequence_parallel,
    )
    if not plans:
        raise FourdError(
            f"no configuration of {gpus} GPUs runs this model with these settings: change --layout, "
            f"--microbatches or --global-batch-tokens (`fourd plan` explains)"
        )
    return plans


def report(plan, result, comm: bool, wall: float, train_tokens: float | None = None) -> dict:
    c = plan.config
    step = result.step_time_s
    flops = plan.global_seqs * plan.seq * plan.model.flops_per_token(plan.seq)
    busy = result.busy_s
    return {
        "step_time_s": step,
        "bubble_fraction": result.bubble_fraction,
        "per_rank_idle_fraction": result.per_rank_idle_fraction,
        "bubble_over_compute": [(result.pipeline_span_s - b) / b for b in busy],
        "tokens_per_s": plan.global_seqs * plan.seq / step,
        "tflops_per_gpu": flops / step / plan.gpus / 1e12,
        "mfu": flops / step / plan.gpus / 1e12 / plan.cluster.gpu.peak_tflops,
        "pipeline_span_s": result.pipeline_span_s,
        "optimizer_s": max(result.optimizer_s),
        "planner_step_time_s": plan.step.step_s,
        "planner_vs_sim": plan.step.step_s / step - 1,
        "comm": comm,
        "layout": {d: getattr(c.layout, d) for d in ("tp", "cp", "pp", "dp")},
        "gpus": plan.gpus,
        "schedule": c.schedule,
        "microbatches": c.microbatches,
        "virtual_stages": c.virtual_stages,
        "micro_batch_seqs": plan.micro_seqs,
        "zero": c.zero,
        "recompute": c.recompute,
        "sequence_parallel": c.sequence_parallel,
        "seq": plan.seq,
        "global_batch_tokens": plan.global_seqs * plan.seq,
        "cluster": plan.cluster.name,
        "transfers": len(result.transfers),
        "sim_wall_s": wall,
        **(
            {"train_tokens": train_tokens, "training_days": train_tokens * step / (plan.global_seqs * plan.seq) / 86400}
            if train_tokens
            else {}
        ),
    }


def simulate_plan(plan, args):
    """Simulate the planner's configuration `plan` with the straggler and throttle flags of `args`."""
    from fourd.schedules import build_schedule
    from fourd.sim.step import simulate_step

    c = plan.config
    start = time.perf_counter()
    schedule = build_schedule(c.schedule, c.layout.pp, c.microbatches, c.virtual_stages)
    result = simulate_step(
        plan.model,
        plan.cluster,
        c.layout,
        schedule,
        plan.seq,
        plan.micro_seqs,
        zero=c.zero,
        recompute=c.recompute,
        comm=not args.no_comm,
        slow_gpu=_slow(args.slow_gpu),
        throttle=diurnal_factor(args.diurnal, args.hour),
        sequence_parallel=c.sequence_parallel,
    )
    return result, time.perf_counter() - start


def run(args) -> int:
    from fourd.plan.cli import count

    if not 0 <= args.hour <= 24 or args.diurnal < 0:
        raise FourdError(
            f"--diurnal {args.diurnal} --hour {args.hour}: the amplitude is a percentage >= 0, the hour 0-24"
        )
    _slow(args.slow_gpu)
    train_tokens = count(args.train_tokens) if args.train_tokens else None
    plans = resolve(args)
    if args.search:
        # The planner's best candidates that fit, ranked again by simulated step time.
        fitting = [p for p in plans if p.fits][: args.top] or plans[:1]
        rows = []
        for plan in fitting:
            result, wall = simulate_plan(plan, args)
            rows.append(report(plan, result, not args.no_comm, wall, train_tokens))
        rows.sort(key=lambda r: r["step_time_s"])
        if args.json:
            print(json.dumps({"best": rows[0], "candidates": rows}))
            return 0
        for i, r in enumerate(rows):
            lay = ",".join(f"{d}={r['layout'][d]}" for d in ("tp", "cp", "pp", "dp"))
            print(
                f"{i + 1:2}. {r['step_time_s']:.4g} s (planner {r['planner_step_time_s']:.4g} s)  {lay} {r['schedule']}"
                f" V={r['virtual_stages']} m={r['microbatches']} ZeRO {r['zero']} recompute {r['recompute']}"
            )
        return 0
    plan = plans[0]
    result, wall = simulate_plan(plan, args)
    out = report(plan, result, not args.no_comm, wall, train_tokens)
    if args.trace:
        from fourd.sim.trace import write_trace

        write_trace(result, args.trace)
    if args.json:
        print(json.dumps(out))
        return 0
    c = plan.config
    print(
        f"{plan.gpus:,} GPUs, layout {c.layout}, {c.schedule}"
        + (f" V={c.virtual_stages}" if c.virtual_stages > 1 else "")
        + f", {c.microbatches} microbatches of {plan.micro_seqs} x {plan.seq} tokens, ZeRO {c.zero}, recompute {c.recompute}"
        + ("" if out["comm"] else ", transfers free")
    )
    print(f"  step time        {out['step_time_s']:.4g} s   (planner {out['planner_step_time_s']:.4g} s)")
    print(
        f"  throughput       {out['tokens_per_s']:,.0f} tokens/s, {out['tflops_per_gpu']:.0f} TFLOP/s per GPU, MFU {100 * out['mfu']:.1f} %"
    )
    print(
        f"  bubble           {100 * out['bubble_fraction']:.1f} % of the pipeline span ({out['pipeline_span_s']:.4g} s) on the busiest rank"
    )
    print(
        "  idle per rank    " + " ".join(f"{100 * x:.1f}" for x in out["per_rank_idle_fraction"]) + "  (% of the step)"
    )
    if args.slow_gpu:
        print(f"  straggler        GPU {args.slow_gpu.replace(':', ' at ')}x")
    if train_tokens:
        print(f"  training         {out['training_days']:.1f} days for {train_tokens:.3g} tokens")
    if args.trace:
        print(f"  trace            {args.trace} (open in Perfetto)")
    print(f"  simulated in     {wall:.2f} s, {out['transfers']} transfers")
    return 0
