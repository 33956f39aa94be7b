"""The readable report of a plan and of a search: tables with units, and why the numbers are what
they are."""

from __future__ import annotations

from dataclasses import replace

from fourd.errors import plural, si
from fourd.layout import Layout
from fourd.plan.cluster import group_level
from fourd.plan.job import block_costs
from fourd.plan.memory import OVERFLOWS, ROOMY, TIGHT, rank_shapes
from fourd.plan.perf import StepTime, attention_times, gradient_sum_time, rank_params
from fourd.plan.search import Plan, Ranking, evaluate
from fourd.plan.stack import load_stack

WHERE = {
    "single": "-",
    "nvlink": "NVLink, inside one server",
    "rack": "NICs, inside one rack switch",
    "pod": "NICs, inside one pod (full bisection)",
    "cross-pod": "NICs, across pods (shared uplinks)",
}
# the search table's mark after a plan's GB, by Memory.room
ROOM_MARKS = {ROOMY: " ", TIGHT: "~", OVERFLOWS: "!"}
MEMORY = (
    ("params", "weights"),
    ("grads", "gradients"),
    ("optimizer", "optimizer state"),
    ("activations", "activations"),
    ("other", "logits, gathered ZeRO-3 layers, cast weights"),
    ("reserve", "runtime: CUDA context, NCCL"),
)


def _layers_worth(model) -> str:
    """The output layer's cost in layers, as a cost split weighs them."""
    layer_cost, head_cost = block_costs(model)
    return f"{head_cost / layer_cost:.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _bubble_shape(p: int, m: int, v: int, schedule: str) -> str:
    if schedule == "zero-bubble":
        return "(p−1)·(t_f + t_i − t_w)/(m·(t_f + t_b))"
    if schedule != "interleaved" or v == 1:
        return f"(p−1)/m = {p - 1}/{m}"
    return (
        f"(p−1)/(V·m) = {p - 1}/({v}·{m})"
        if m >= p
        else f"(p−1−(V−1)(m−1)/V)/m = ({p - 1}−{v - 1}·{m - 1}/{v})/{m}"
    )


def why(plan: Plan) -> list[str]:
    """Sentences explaining where the step goes."""
    config, step, lay = plan.config, plan.step, plan.config.layout
    lines, per_replica = [], plan.global_seqs // lay.dp
    if lay.pp > 1:
        lines.append(
            f"Pipeline bubble: each replica gets {plural(per_replica, 'sequence')}, so "
            f"{plural(config.microbatches, 'microbatch')}; the {config.schedule} schedule idles "
            f"{_bubble_shape(lay.pp, config.microbatches, config.virtual_stages, config.schedule)} "
            f"= {_pct(step.bubble_s / step.compute_s)} of compute ({_pct(plan.bubble_fraction)} of "
            "the step)."
        )
        counts = plan.job.stage_layers
        if plan.job.work.pipeline_split == "cost" and config.virtual_stages == 1:
            lines.append(
                f"Stack {plan.job.stack} splits the {plan.model.layers} layers over the pipeline by "
                f"cost, the output layer weighing {_layers_worth(plan.model)} layers: "
                f"{', '.join(map(str, counts))}."
            )
    if (
        lay.pp > 1 and lay.dp % 2 == 0
    ):  # the same global batch on half the replicas, each twice the sequences
        half = Layout(lay.tp, lay.cp, lay.pp, lay.dp // 2)
        other = evaluate(
            replace(
                plan.job, par=replace(config, layout=half, microbatches=2 * config.microbatches)
            )
        )
        lines.append(
            f"With half the replicas (dp={half.dp}, {2 * per_replica} sequences and "
            f"{other.config.microbatches} microbatches each, same global batch on {other.gpus:,} "
            f"GPUs) the bubble would be {_pct(other.step.bubble_s / other.step.compute_s)} of "
            f"compute and MFU {_pct(other.mfu)} instead of {_pct(plan.mfu)}: fewer sequences per "
            "replica mean fewer microbatches to fill the pipeline."
        )
    for part, what in (
        (step.tp_comm_s, tp_collectives_words(plan)),
        (step.cp_comm_s, "CP all-gathers of K and V"),
    ):
        lines += [f"{what} take {_pct(part / step.step_s)} of the step."] if part else []
    return lines + _attention_lines(plan) + _recompute_lines(plan) + _gradient_lines(plan)


def tp_collectives_words(plan: Plan) -> str:
    """What Why calls the TP time of a step: all of its collectives, or with TP overlap the part of
    them the GEMMs beside them do not hide (fourd.plan.perf.exposed_layer_comm)."""
    if plan.job.work.tp_overlap:
        return "TP collectives the overlap leaves exposed"
    return "TP collectives (not overlapped)"


def _slowest_rank_layers(plan: Plan) -> int:
    """Transformer layers the step's slowest pipeline rank runs, all its stages together."""
    job, config = plan.job, plan.config
    layers = rank_shapes(
        job.model, config.layout.pp, config.virtual_stages, job.work.pipeline_split
    )
    return layers[0][plan.step.slowest_rank]


def _attention_lines(plan: Plan) -> list[str]:
    """Why's sentence on the attention core where it takes a tenth of the step or more (long
    sequences): its seconds a step on the slowest rank, each layer's forward and backward a
    microbatch (fourd.plan.perf.attention_times) and the forward again where the layer or the
    attention is recomputed, and its share of the model FLOPs at this sequence,
    12·L·H·Q·T over MFU's count (ModelConfig.attention_flops_per_token)."""
    job, config, step = plan.job, plan.config, plan.step
    forward, backward = attention_times(job.work)
    if job.work.recompute == "full" or job.work.recomputes_attention:
        backward += forward
    seconds = (forward + backward) * _slowest_rank_layers(plan) * config.microbatches
    if seconds < step.step_s / 10:
        return []
    flops_share = job.model.attention_flops_per_token(plan.seq) / job.model.flops_per_token(
        plan.seq
    )
    return [
        f"Attention at {plan.seq:,} tokens a sequence: its kernels take {seconds:.3f} s per step on "
        f"the slowest rank ({_pct(seconds / step.step_s)} of the step) and do "
        f"{_pct(flops_share)} of the model FLOPs."
    ]


def _recompute_lines(plan: Plan) -> list[str]:
    """Why's sentence on a selective recomputation that runs the fused attention kernel again
    (a stack whose `selective` is "attention", Megatron-Core's): its seconds on the slowest rank,
    one attention forward a layer a microbatch."""
    job, config = plan.job, plan.config
    work = job.work
    if work.attention != "flash" or not work.recomputes_attention:
        return []
    forward_again, _ = attention_times(work)
    seconds = forward_again * _slowest_rank_layers(plan) * config.microbatches
    return [
        f"Stack {job.stack}'s selective recomputation runs each layer's fused attention kernel "
        f"again in its backward: {seconds:.3f} s per step ({_pct(seconds / plan.step.step_s)})."
    ]


def _gradient_lines(plan: Plan) -> list[str]:
    """Why's sentences on the gradients: a stack's FP32 sum apart, the data-parallel traffic, the
    stack's buckets and a weight gather inside the optimizer's step."""
    step, job, lines = plan.step, plan.job, []
    summed = gradient_sum_time(job, rank_params(job)) * plan.config.microbatches
    if summed:
        lines.append(
            f"Stack {job.stack} adds each microbatch's BF16 weight gradients into FP32 copies "
            f"in a pass of their own: {summed:.3f} s per step ({_pct(summed / step.step_s)})."
        )
    if not step.dp_total_s:
        return lines
    lines.append(
        f"Data-parallel traffic: {step.dp_total_s:.3f} s per step, {step.dp_exposed_s:.3f} s "
        f"of it exposed (the rest hides behind compute and slows it by {step.overlap_s:.3f} s)."
    )
    bucket_mb = load_stack(job.stack).dp_bucket_mb
    if bucket_mb:
        lines.append(
            f"Stack {job.stack} reduces the gradients in buckets of {bucket_mb:g} MiB, "
            "each its own collective call (and latency)."
        )
    if job.gathers_in_step and step.dp_exposed_s:
        lines.append(
            f"Stack {job.stack} gathers ZeRO {plan.config.zero}'s updated weights inside the "
            "optimizer's step, where no compute hides them."
        )
    return lines + _sharding_lines(plan)


def _sharding_lines(plan: Plan) -> list[str]:
    """Why's sentences on a stack that reduces ZeRO's gradients or gathers its weights otherwise than
    by one reduce-scatter and one all-gather (InternEvo's Hybrid ZeRO)."""
    job, lines = plan.job, []
    if job.reduces_whole_gradients:
        lines.append(
            f"Stack {job.stack} all-reduces the whole gradients, each rank keeping its shard's: "
            "twice the bytes of a reduce-scatter."
        )
    if job.broadcasts_weights:
        ranks = job.par.shard_ranks
        lines.append(
            f"Stack {job.stack} broadcasts each rank's updated weights on its own: "
            f"{plural(ranks, 'broadcast')} over {ranks:,} ranks a step, each paying a ring's "
            "latency."
        )
    return lines


PIPELINE_WORDS = {"blocking": " · blocking pipeline sends", "synchronous": " · synchronous sends"}


def kernels_word(job) -> str:
    """How the blocks' elementwise ops run: compiled, the stack's fused kernels, or eager."""
    if job.compiled:
        return "compiled"
    return "fused kernels" if job.work.fused else "eager"


def _cudnn_attention(job) -> bool:
    """Attention in cuDNN's fused kernel (not FlashAttention-2's, not the scores in memory)."""
    return job.work.attention == "flash" and job.work.fused_attention == "cudnn"


def plan_report(plan: Plan, train_tokens: float | None = None) -> str:
    """The text report of one plan: what runs, where each group sits, memory, step time,
    throughput, and why."""
    out = _header_lines(plan)
    order = plan.job.work.rank_order
    out += ["", f"Placement (ranks innermost first: {order.upper().replace('-', ', ')})"]
    out += [
        f"  {dim}={getattr(plan.config.layout, dim):<6} {WHERE[group_level(group, plan.cluster)]}"
        for dim, group in plan.job.work.groups.items()
    ]
    out += _memory_lines(plan)
    out += _step_lines(plan.step)
    out += _throughput_lines(plan, train_tokens)
    return "\n".join(out + ["", "Why"] + [f"  - {line}" for line in why(plan)])


def _header_lines(plan: Plan) -> list[str]:
    """The report's first lines: GPUs, model, tokens per step, and the configuration that runs
    (with the settings the planner chose, when it chose any)."""
    config, cluster, job = plan.config, plan.cluster, plan.job
    schedule = config.schedule
    if config.schedule == "interleaved":
        schedule += f" V={config.virtual_stages}"
    pipeline_words = PIPELINE_WORDS.get(job.pipeline_sends, "") if config.layout.pp > 1 else ""
    out = [
        f"fourd plan: {plan.gpus:,} × {cluster.gpu.name} ({cluster.name}, "
        f"{(job.precision or cluster.dtype).upper()}), model with {si(plan.model.params())} "
        f"parameters, {plan.seq:,}-token sequences, {plan.global_seqs * plan.seq:,} tokens per "
        "step",
        f"  {config.layout} · {schedule} · {plural(config.microbatches, 'microbatch')} of "
        f"{plan.micro_seqs} × "
        f"{plan.seq:,} tokens · ZeRO {config.zero} · recompute {config.recompute} · "
        f"{kernels_word(job)} · stack {job.stack}"
        f"{' · TP overlapped' if job.work.tp_overlap else ''}"
        f"{' · cuDNN attention' if _cudnn_attention(job) else ''}"
        f"{' · autocast over FP32 weights' if job.work.autocast else ''}"
        f"{'' if job.dp_overlapped else ' · DP after backward'}"
        f"{pipeline_words}",
    ]
    if plan.chosen:
        chosen = ", ".join(plan.chosen)
        out.append(
            f"  chosen by the planner (fastest that fits with the allocator's cache): {chosen}"
        )
    return out


def _memory_lines(plan: Plan) -> list[str]:
    """The memory table of the fullest pipeline rank, its total against the GPU's, and the
    allocator's cache."""
    gigabytes = plan.memory.gb()
    out = ["", "Memory per GPU (the fullest pipeline rank)        GB"]
    out += [f"  {label:<44} {gigabytes[key]:>7.1f}" for key, label in MEMORY]
    total = f"total of {plan.cluster.gpu.memory_gb:.0f} GB"
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    if plan.fits and not plan.fits_with_cache:
        # the caching allocator, short of memory, frees its cached blocks and retries the
        # allocation: each retry synchronizes the GPU (torch.cuda.memory_stats' num_alloc_retries)
        verdict = "fits only by emptying the allocator's cache (retries slow the steps)"
    out.append(f"  {total:<44} {gigabytes['total'] + gigabytes['reserve']:>7.1f}  {verdict}")
    cache = "and the allocator cache (freed when short)"
    out.append(f"  {cache:<44} {gigabytes['fragmentation']:>7.1f}")
    return out


def _step_lines(step: StepTime) -> list[str]:
    """The step-time table: each term, its share of the step (the "of which" rows only when
    not zero), and the step."""
    rows = [
        ("compute (TP and CP collectives included)", step.compute_s),
        ("  of which TP collectives", step.tp_comm_s),
        ("  of which CP collectives", step.cp_comm_s),
        ("pipeline bubble", step.bubble_s),
        ("pipeline sends on the critical path", step.p2p_s),
        ("data-parallel collectives, exposed", step.dp_exposed_s),
        ("compute slowed by overlapped collectives", step.overlap_s),
        ("optimizer update", step.optimizer_s),
    ]
    out = ["", "Step time                                          s      share"]
    out += [
        f"  {term:<44} {seconds:>9.3f}  {_pct(seconds / step.step_s):>7}"
        for term, seconds in rows
        if seconds or not term.startswith("  ")
    ]
    out.append(f"  {'step':<44} {step.step_s:>9.3f}")
    return out


def _throughput_lines(plan: Plan, train_tokens: float | None) -> list[str]:
    """Tokens/s, model and hardware TFLOP/s per GPU, MFU, the bubble's share and, given a
    token budget, the days it takes."""
    rows = [
        ("tokens/s", f"{plan.tokens_per_s:,.0f}"),
        ("model TFLOP/s per GPU", f"{plan.tflops_per_gpu:.1f}"),
        ("hardware TFLOP/s per GPU (recomputation)", f"{plan.hw_tflops_per_gpu:.1f}"),
        (f"MFU (of {plan.peak_tflops:g} TFLOP/s peak)", _pct(plan.mfu)),
        ("bubble fraction of the step", _pct(plan.bubble_fraction)),
    ]
    if train_tokens:
        days = train_tokens / plan.tokens_per_s / 86400
        rows.append((f"days for {train_tokens:.3g} tokens", f"{days:.1f}"))
    return ["", "Throughput"] + [f"  {term:<43}{value:>14}" for term, value in rows]


def search_json(candidates: list[dict], ranking: Ranking) -> dict:
    """`--search --json`'s object but the intervals' verdict: the best candidate, every candidate
    listed (each plan's JSON, as the caller made it), what was searched and how many fit."""
    return {
        "best": candidates[0],
        "candidates": candidates,
        "searched": ranking.searched,
        "fitting": ranking.fitting,
    }


def search_report(ranking: Ranking, train_tokens: float | None = None) -> str:
    """`--search`'s text: what was searched, the best plan in full, then the ranking's plans one a
    line."""
    plans = ranking.plans
    head = (
        f"  {'layout':<26} {'schedule':<14} {'m':>4} {'mbs':>4} {'zero':>4} {'recompute':<9} "
        f"{'GB':>6} {'step s':>8} "
    )
    out = [
        f"searched {ranking.searched:,} configurations, {ranking.fitting:,} fit in memory; the "
        "best:",
        "",
        plan_report(plans[0], train_tokens),
        "",
        f"Top {len(plans)} (fitting with the allocator's cache first, then fitting without it; by "
        "tokens/s)",
        head + f"{'tokens/s':>12} {'MFU':>7}",
    ]
    for plan in plans:
        config = plan.config
        sched = config.schedule + (
            f" V={config.virtual_stages}" if config.schedule == "interleaved" else ""
        )
        out.append(
            f"  {str(config.layout):<26} {sched:<14} {config.microbatches:>4} {plan.micro_seqs:>4} "
            f"{config.zero:>4} {config.recompute:<9} "
            f"{(plan.memory.total + plan.memory.reserve) / 1e9:>6.1f}{ROOM_MARKS[plan.room]} "
            f"{plan.step.step_s:>8.3f} {plan.tokens_per_s:>12,.0f} {_pct(plan.mfu):>7}"
        )
    if any(plan.room == TIGHT for plan in plans):
        out.append("  (~: fits only by emptying the allocator's cache; its retries slow the steps)")
    if not plans[0].fits:
        out.append(
            "  (!: does not fit; no configuration fits: add GPUs, shorten sequences or use a "
            "bigger GPU)"
        )
    return "\n".join(out)
