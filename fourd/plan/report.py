"""The readable report of a plan and of a search: tables with units, and why the numbers are what they are."""

from __future__ import annotations

from fourd.layout import Layout
from fourd.plan.search import Plan, evaluate

LEVEL_WORDS = {
    "single": "-",
    "nvlink": "NVLink, inside one server",
    "rack": "NICs, inside one rack switch",
    "pod": "NICs, inside one pod (full bisection)",
    "cross-pod": "NICs, across pods (shared uplinks)",
}


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _config_line(plan: Plan) -> str:
    c = plan.config
    sched = c.schedule + (f" V={c.virtual_stages}" if c.schedule == "interleaved" else "")
    return (
        f"{c.layout} · {sched} · {c.microbatches} microbatches of {plan.micro_seqs} × {plan.seq:,} tokens"
        f" · ZeRO {c.zero} · recompute {c.recompute}"
    )


def _counterfactual(plan: Plan) -> Plan | None:
    """The same run with half the replicas, each twice the sequences (the global batch unchanged)."""
    c = plan.config
    lay = c.layout
    if lay.dp % 2 or lay.pp == 1:
        return None
    return evaluate(
        plan.job.with_par(layout=Layout(lay.tp, lay.cp, lay.pp, lay.dp // 2), microbatches=2 * c.microbatches)
    )


def why(plan: Plan) -> list[str]:
    """Sentences explaining where the step goes."""
    c, s = plan.config, plan.step
    lines = []
    p, m, v = c.layout.pp, c.microbatches, c.virtual_stages
    if p > 1:
        per_replica = plan.global_seqs // c.layout.dp
        shape = {
            "interleaved": f"(p−1)/(V·m) = {p - 1}/({v}·{m})"
            if m >= p
            else f"(p−1−(V−1)(m−1)/V)/m, m < p, = ({p - 1}−{v - 1}·{m - 1}/{v})/{m}",
            "gpipe": f"(p−1)/m = {p - 1}/{m}",
            "1f1b": f"(p−1)/m = {p - 1}/{m}",
            "zero-bubble": "(p−1)·(t_f + t_i − t_w)/(m·(t_f + t_b))",
        }[c.schedule]
        lines.append(
            f"Pipeline bubble: each replica gets {per_replica} sequences, so {m} microbatches; the "
            f"{c.schedule} schedule idles {shape} = {_pct(s.bubble_s / s.compute_s)} of compute "
            f"({_pct(plan.bubble_fraction)} of the step)."
        )
        other = _counterfactual(plan)
        if other is not None:
            lines.append(
                f"With half the replicas (dp={other.config.layout.dp}, {2 * per_replica} sequences and "
                f"{other.config.microbatches} microbatches each, same global batch on {other.gpus:,} GPUs) "
                f"the bubble would be {_pct(other.step.bubble_s / other.step.compute_s)} of compute and MFU "
                f"{_pct(other.mfu)} instead of {_pct(plan.mfu)}: fewer sequences per replica mean fewer "
                f"microbatches to fill the pipeline."
            )
    if s.tp_comm_s:
        lines.append(f"TP collectives (not overlapped) take {_pct(s.tp_comm_s / s.step_s)} of the step.")
    if s.cp_comm_s:
        lines.append(f"CP all-gathers of K and V take {_pct(s.cp_comm_s / s.step_s)} of the step.")
    if s.dp_total_s:
        lines.append(
            f"Data-parallel traffic: {s.dp_total_s:.3f} s per step, {s.dp_exposed_s:.3f} s of it exposed "
            f"(the rest hides behind compute and slows it by {s.overlap_s:.3f} s)."
        )
    return lines


def plan_report(plan: Plan, train_tokens: float | None = None) -> str:
    c, s, mem = plan.config, plan.step, plan.memory
    cl, model = plan.cluster, plan.model
    out = [
        f"fourd plan: {plan.gpus:,} × {cl.gpu.name} ({cl.name}, {cl.dtype.upper()}), model with "
        f"{model.params() / 1e9:,.1f} B parameters, {plan.seq:,}-token sequences, "
        f"{plan.global_seqs * plan.seq:,} tokens per step",
        f"  {_config_line(plan)}",
    ]
    if plan.chosen:
        out.append(f"  chosen by the planner (fastest that fits): {', '.join(plan.chosen)}")
    out += ["", "Placement (ranks innermost first: TP, CP, PP, DP)"]
    for dim, level in plan.placement_levels().items():
        out.append(f"  {dim}={getattr(c.layout, dim):<6} {LEVEL_WORDS[level]}")
    g = mem.gb()
    out += ["", "Memory per GPU (the fullest pipeline rank)        GB"]
    for key, label in (
        ("params", "weights"),
        ("grads", "gradients"),
        ("optimizer", "optimizer state"),
        ("activations", "activations"),
        ("other", "logits, buffers"),
        ("fragmentation", "allocator cache (fragmentation)"),
        ("reserve", "runtime: CUDA context, NCCL"),
    ):
        out.append(f"  {label:<44} {g[key]:>7.1f}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    out.append(f"  {'total of ' + format(cl.gpu.memory_gb, '.0f') + ' GB':<44} {mem.held / 1e9:>7.1f}  {verdict}")
    out += ["", "Step time                                          s      share"]
    rows = [
        ("compute (TP and CP collectives included)", s.compute_s),
        ("  of which TP collectives", s.tp_comm_s),
        ("  of which CP collectives", s.cp_comm_s),
        ("pipeline bubble", s.bubble_s),
        ("pipeline sends on the critical path", s.p2p_s),
        ("data-parallel collectives, exposed", s.dp_exposed_s),
        ("compute slowed by overlapped collectives", s.overlap_s),
        ("optimizer update", s.optimizer_s),
    ]
    for label, value in rows:
        if value or not label.startswith("  "):
            out.append(f"  {label:<44} {value:>9.3f}  {_pct(value / s.step_s):>7}")
    out.append(f"  {'step':<44} {s.step_s:>9.3f}")
    out += [
        "",
        "Throughput",
        f"  tokens/s                                   {plan.tokens_per_s:>14,.0f}",
        f"  model TFLOP/s per GPU                      {plan.tflops_per_gpu:>14.1f}",
        f"  hardware TFLOP/s per GPU (recomputation)   {plan.hw_tflops_per_gpu:>14.1f}",
        f"  MFU (of {cl.gpu.peak_tflops:g} TFLOP/s peak)               {_pct(plan.mfu):>14}",
        f"  bubble fraction of the step                {_pct(plan.bubble_fraction):>14}",
    ]
    if train_tokens:
        days = train_tokens / plan.tokens_per_s / 86400
        out.append(f"  days for {train_tokens:.3g} tokens                {days:>14.1f}")
    out += ["", "Why"] + [f"  - {line}" for line in why(plan)]
    return "\n".join(out)


def search_report(plans: list[Plan], top: int, train_tokens: float | None = None) -> str:
    best = plans[0]
    fitting = sum(p.fits for p in plans)
    out = [
        f"searched {len(plans):,} configurations, {fitting:,} fit in memory; the best:",
        "",
        plan_report(best, train_tokens),
        "",
        f"Top {min(top, len(plans))} (fitting first, by tokens/s)",
        f"  {'layout':<26} {'schedule':<14} {'m':>4} {'mbs':>4} {'zero':>4} {'recompute':<9} {'GB':>6} "
        f"{'step s':>8} {'tokens/s':>12} {'MFU':>7}",
    ]
    for p in plans[:top]:
        c = p.config
        sched = c.schedule + (f" V={c.virtual_stages}" if c.schedule == "interleaved" else "")
        gb = p.memory.held / 1e9
        out.append(
            f"  {str(c.layout):<26} {sched:<14} {c.microbatches:>4} {p.micro_seqs:>4} {c.zero:>4} "
            f"{c.recompute:<9} {gb:>6.1f}{'' if p.fits else '!'} {p.step.step_s:>8.3f} "
            f"{p.tokens_per_s:>12,.0f} {_pct(p.mfu):>7}"
        )
    if not best.fits:
        out.append("  (!: does not fit; no configuration fits: add GPUs, shorten sequences or use a bigger GPU)")
    return "\n".join(out)
