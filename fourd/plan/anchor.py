"""Anchored predictions (`fourd plan --anchor FILE`, `fourd sim step --anchor FILE`): a measured
step of the same model on the same stack at a small scale pins what the planner cannot know about a
stack (how fast its kernels run, its fixed costs, its memory overhead); the planner's own model
keeps what changes with scale (collectives by group size and span, the bubble at the new microbatch
count, exposed data-parallel traffic).

The anchor file is one JSON object with the keys of `fourd plan --json` where they overlap
(docs/planner.md, "Anchored predictions and intervals"); `fourd train` writes one, `anchor.json`, in
every run directory. Built on the planner's public outputs only: a Plan, its step time and the terms
of its breakdown."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fourd.errors import FourdError
from fourd.layout import parse_layout
from fourd.model.config import ModelConfig, get_preset, parse_model_spec
from fourd.plan import request
from fourd.plan.cluster import Cluster, load_cluster
from fourd.plan.memory import GB
from fourd.plan.search import Plan, Ranking, evaluate, ranked
from fourd.plan.stack import load_stack

# Keys the anchor must give, and the optional ones the planner reads; any other key is ignored.
REQUIRED = (
    "cluster",
    "gpus",
    "layout",
    "schedule",
    "microbatches",
    "seq",
    "global_batch_tokens",
    "recompute",
    "zero",
    "sequence_parallel",
    "step_time_s",
)
# Settings of the anchor's own configuration a target inherits unless its flags say otherwise: how
# the stack runs (precision, compile, kernels) and what one step trains (sequence, batch,
# memory-saving choices).
INHERITED = (
    "seq",
    "global_batch_tokens",
    "recompute",
    "zero",
    "sequence_parallel",
    "precision",
    "compiled",
    "attention",
    "pipeline_comm",
    "tp_overlap",
    "dp_overlap",
    "fused_kernels",
    "fused_attention",
)
# ... and, when the target names neither GPUs nor a layout, its layout too: the anchor's own
# configuration.
OWN_LAYOUT = ("gpus", "layout", "schedule", "microbatches", "virtual_stages", "hsdp_replicas")
# A measured rate this many times off the model's, either way, is flagged in the report: on the
# validation suite's anchors the stacks run at 0.8 to 1.4 × the model's time, and the one anchor
# beyond (nanotron's 80B on 4 nodes, 3.0 ×) carried its slowness to every other layout of its series
# (docs/planner.md, Validation).
FAR_RATE = 2.0


@dataclass(frozen=True)
class Anchor:
    """A measured step: the model, the cluster it ran on, its settings (request.SETTINGS names),
    what it took."""

    path: str
    model: ModelConfig
    cluster: Cluster
    values: dict[str, Any]
    step_time_s: float
    peak_memory_gb: float | None = None
    forward_backward_s: float | None = None
    stack: str = "fourd"


def _fail(path: str, problem: str) -> FourdError:
    return FourdError(f"anchor {path}: {problem}")


def _positive(path: str, data: dict, key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        unit = "GB" if key.endswith("_gb") else "seconds"
        raise _fail(path, f"{key} = {value!r} must be a positive number ({unit})")
    if not math.isfinite(value):
        raise _fail(path, f"{key} = {value!r} must be finite")
    return float(value)


def _model(path: str, data: dict) -> ModelConfig:
    """`model` as a preset name or as `fourd plan --json` writes it (a table of fields), or
    `model_spec`."""
    model, spec = data.get("model"), data.get("model_spec")
    if (model is None) == (spec is None):
        raise _fail(path, "give one of model (a preset or its fields) and model_spec")
    try:
        if isinstance(model, dict):
            return ModelConfig(**model)
        return get_preset(model) if isinstance(model, str) else parse_model_spec(str(spec))
    except TypeError as e:
        raise _fail(path, f"model {str(model)[:80]}: {e}") from None
    except FourdError as e:
        raise _fail(path, str(e)) from None


def _layout_text(value: Any) -> str:
    """The layout as `tp=,cp=,pp=,dp=` text, whether the file gives the text or `--json`'s table."""
    if isinstance(value, dict):
        return ",".join(f"{k}={degree}" for k, degree in value.items())
    return str(value)


def load_anchor(path: str | Path) -> Anchor:
    """The anchor file at `path`, checked: FourdError naming the key and the fix."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise _fail(
            where, f"cannot be read ({e.strerror}): give the anchor.json of a run"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(where, f"is not JSON ({e}): give one JSON object") from None
    if not isinstance(data, dict):
        raise _fail(where, "must be one JSON object (keys as `fourd plan --json` writes them)")
    if missing := [k for k in REQUIRED if data.get(k) is None]:
        raise _fail(where, f"missing required key(s) {', '.join(missing)}")
    model = _model(where, data)
    try:
        cluster = load_cluster(str(data["cluster"]))
    except FourdError as e:
        raise _fail(where, str(e)) from None
    values = {
        "gpus": data["gpus"],
        "layout": _layout_text(data["layout"]),
        "precision": data.get("dtype"),
        "hsdp_replicas": data.get("hsdp_replicas"),
    }
    values |= {
        k: data.get(k) for k in request.SETTINGS if k in data and k not in values and k != "stack"
    }
    values = {k: value for k, value in values.items() if k in request.SETTINGS}
    return Anchor(
        path=where,
        model=model,
        cluster=cluster,
        values=values,
        step_time_s=_positive(where, data, "step_time_s") or 0.0,
        peak_memory_gb=_positive(where, data, "peak_memory_gb"),
        forward_backward_s=_positive(where, data, "forward_backward_s"),
        stack=str(data.get("stack") or "fourd"),
    )


def chip(cluster: Cluster) -> str:
    """The GPU chip a profile describes (its GPU name's first word: A100, H100, H200, CPU): what an
    anchor's achieved rate carries to. Memory size and the network may differ (a dev node and the
    big cluster)."""
    return cluster.gpu.name.split()[0].upper() if cluster.gpu.name else cluster.name


def _with_stack(values: dict, stack: str) -> dict:
    """The anchor's stack for the planner where it has a profile of it (fourd.plan.stack); a stack
    it has none of (a private fork, Meta's own) is planned with fourd's switches, and the anchor
    pins its rate."""
    try:
        load_stack(stack)
    except FourdError:
        return values
    return values | {"stack": stack}


def own_plan(anchor: Anchor) -> Plan:
    """The planner's plan of the anchor's own configuration, on the anchor's own cluster."""
    try:
        req = request.resolve(
            anchor.model, anchor.cluster, _with_stack(anchor.values, anchor.stack)
        )
        return request.plans(req, top=1)[0]
    except FourdError as e:
        raise _fail(anchor.path, str(e)) from None


@dataclass(frozen=True)
class Split:
    """A plan's step cut in two: the local work a stack's kernels do (its rate is what an anchor
    pins) and the scale-out the planner models (collectives, the communication part of the bubble,
    sends, exposed DP)."""

    compute: float  # m·(t_f + t_b) without the TP and CP collectives in it
    bubble: float  # the bubble's compute-bound part: bubble × compute/(compute + TP + CP)
    optimizer: float
    scale_out: float  # the rest of the step

    @property
    def local(self) -> float:
        return self.compute + self.bubble + self.optimizer


def split(plan: Plan) -> Split:
    """Split a plan's step: compute = compute_s − tp_comm_s − cp_comm_s; the bubble is idle time of
    microbatches of that same mix, so its compute-bound part is bubble_s × compute/compute_s;
    scale-out is everything else of step_s (TP, CP, the bubble's collectives, p2p, exposed DP,
    overlap, and any term the model adds later, which stays the model's)."""
    times = plan.step
    compute = max(0.0, times.compute_s - times.tp_comm_s - times.cp_comm_s)
    bubble = times.bubble_s * compute / times.compute_s if times.compute_s else 0.0
    rest = times.step_s - compute - bubble - times.optimizer_s
    return Split(compute, bubble, times.optimizer_s, rest)


@dataclass(frozen=True)
class Pinned:
    """What an anchor's measurement pins: the stack's achieved rate against the model (rate:
    measured local time over modelled), the per-step cost beyond the microbatches when a
    forward/backward time is given, the memory the model misses per GPU."""

    rate: float
    # measured per-step local cost (optimizer, launches, syncs) at the anchor; None: rate·optimizer
    step_cost_s: float | None
    anchor_optimizer_s: float
    memory_overhead_gb: float | None
    measured_s: float
    modelled_s: float


def pin(anchor: Anchor, plan: Plan) -> Pinned:
    """What the anchor's measured step pins, against the planner's plan of the same configuration.

    Without a forward/backward time one ratio carries the stack's speed: the measured step minus the
    modelled scale-out is the local time the stack took, so

        rate = (T_measured − scale_out_model) / (compute + bubble_compute + optimizer)_model

    which makes rate·local + scale_out reproduce the measured step exactly.

    With `forward_backward_s` (one microbatch's forward and backward alone, with its TP and CP
    collectives) the microbatch's own rate is measured apart from the step:

        rate = (t_fb − (tp + cp)/m) / (compute/m)

    and what the step has beyond its microbatches, bubble and scale-out is its per-step cost

        step_cost = T_measured − rate·(compute + bubble_compute) − scale_out_model

    (the optimizer, kernel launches and syncs between microbatches' work: measured, not modelled).
    One microbatch size cannot tell a fixed per-microbatch cost from a slower rate, so the two stay
    one figure, measured at the anchor's microbatch shape. A step_cost below zero (microbatches
    measured alone slower than inside the step) is kept at 0."""
    parts, times = split(plan), plan.step
    measured = anchor.step_time_s
    microbatches = plan.config.microbatches
    step_cost = None
    if anchor.forward_backward_s is not None and parts.compute > 0:
        comm = (times.tp_comm_s + times.cp_comm_s) / microbatches
        rate = (anchor.forward_backward_s - comm) / (parts.compute / microbatches)
        step_cost = max(0.0, measured - rate * (parts.compute + parts.bubble) - parts.scale_out)
    else:
        rate = (measured - parts.scale_out) / parts.local if parts.local > 0 else 0.0
    if not rate > 0:
        raise _fail(
            anchor.path,
            f"step_time_s = {measured:g} s is shorter than the planner's modelled communication of "
            f"its own configuration ({parts.scale_out:.4g} s): check the measurement and its "
            "layout",
        )
    overhead = None
    if anchor.peak_memory_gb is not None:
        overhead = anchor.peak_memory_gb - plan.peak_gb
    return Pinned(
        rate=rate,
        step_cost_s=step_cost,
        anchor_optimizer_s=times.optimizer_s,
        memory_overhead_gb=overhead,
        measured_s=measured,
        modelled_s=times.step_s,
    )


def predict(plan: Plan, pinned: Pinned) -> Plan:
    """The target's plan with the anchor's pinned terms: the local work at the measured rate, the
    model's scale-out of the target as it is.

        T_target = rate·(compute + bubble_compute)_target + optimizer'_target + scale_out_target

    optimizer' is rate·optimizer without a forward/backward time; with one it is the anchor's
    measured per-step cost, scaled by how the target's optimizer work compares with the anchor's
    (ZeRO shards it over more ranks: optimizer_target / optimizer_anchor). The memory overhead is
    added per GPU to the runtime's reserve: what the model misses (allocator, runtime, buffers) does
    not shrink with the shard."""
    parts, times = split(plan), plan.step
    if pinned.step_cost_s is None:
        optimizer = pinned.rate * parts.optimizer
    else:
        ratio = parts.optimizer / pinned.anchor_optimizer_s if pinned.anchor_optimizer_s else 1.0
        optimizer = pinned.step_cost_s * ratio
    compute = pinned.rate * parts.compute
    bubble = pinned.rate * parts.bubble + (times.bubble_s - parts.bubble)
    step = compute + pinned.rate * parts.bubble + optimizer + parts.scale_out
    new_step = replace(
        times,
        step_s=step,
        compute_s=compute + times.tp_comm_s + times.cp_comm_s,
        bubble_s=bubble,
        optimizer_s=optimizer,
    )
    memory = plan.memory
    if pinned.memory_overhead_gb is not None:
        memory = replace(memory, reserve=memory.reserve + pinned.memory_overhead_gb * GB)
    return replace(plan, step=new_step, memory=memory)


def far_from_model(pinned: Pinned) -> bool:
    """Whether the anchor's local work ran FAR_RATE times slower or faster than the model's."""
    return not 1 / FAR_RATE <= pinned.rate <= FAR_RATE


def terms(pinned: Pinned) -> tuple[list[str], list[str]]:
    """(anchored, modelled): the breakdown terms each side gives (`--json`'s anchored_terms,
    modelled_terms)."""
    anchored = ["compute", "bubble (compute-bound part)", "optimizer"]
    if pinned.step_cost_s is not None:
        anchored[-1] = "optimizer and per-step cost"
    if pinned.memory_overhead_gb is not None:
        anchored.append("memory overhead")
    modelled = ["tp_comm", "cp_comm", "bubble (communication part)", "p2p", "dp_exposed", "overlap"]
    if pinned.memory_overhead_gb is None:
        modelled.append("memory")
    else:
        modelled.append("memory (tensors)")
    return anchored, modelled


# ---- the commands --------------------------------------------------------------------------------


def target_request(args, anchor: Anchor, own: Plan) -> tuple[request.Request, tuple[str, ...]]:
    """The target of `fourd plan --anchor`, and the settings it took from the anchor: the flags
    given, the rest from the anchor (INHERITED; with neither --gpus nor --layout, the anchor's own
    layout too, or with --search its GPU count; a pipeline's schedule and virtual stages,
    `pipeline_settings`, the virtual stages as `own`, the anchor's own plan, ran them where the file
    leaves them open). The same model as the anchor and a cluster of the same GPU chip, or
    FourdError."""
    if args.model or args.model_spec:
        model = args.model_spec or get_preset(args.model)
        if model != anchor.model:
            raise FourdError(
                f"the model asked differs from the anchor's ({anchor.path}): an anchor pins one "
                f"model's rate; leave out --model/--model-spec or measure an anchor of this model"
            )
    cluster = load_cluster(args.cluster) if args.cluster else anchor.cluster
    if chip(cluster) != chip(anchor.cluster):
        raise FourdError(
            f"cluster {cluster.name} has {cluster.gpu.name} GPUs but the anchor ({anchor.path}) "
            f"ran on {anchor.cluster.gpu.name}: an anchor pins one GPU's rate; plan on a profile "
            "of that GPU"
        )
    if getattr(args, "stack", None) and str(args.stack) != anchor.stack:
        raise FourdError(
            f"--stack {args.stack} differs from the anchor's stack {anchor.stack} ({anchor.path}): "
            "an anchor pins one stack's rate; leave out --stack or measure an anchor on that stack"
        )
    given = {k: getattr(args, k, None) for k in request.SETTINGS if k != "global_seqs"}
    inherit: tuple[str, ...] = INHERITED
    if args.search and not (args.gpus or args.layout):
        inherit += ("gpus",)  # every layout of the anchor's GPU count
    elif not (args.gpus or args.layout):
        inherit += OWN_LAYOUT
    values = {k: value for k, value in given.items() if value is not None}
    taken = {
        k: anchor.values[k] for k in inherit if k not in values and anchor.values.get(k) is not None
    }
    taken |= pipeline_settings(values | taken, ran_pipeline(anchor, own))
    values |= taken
    return request.resolve(anchor.model, cluster, _with_stack(values, anchor.stack)), tuple(taken)


def ran_pipeline(anchor: Anchor, own: Plan) -> dict:
    """The anchor's settings with the virtual stages its pipeline ran: as the file states them, else
    as the planner planned the anchor's own configuration (the V its rate was pinned at), so that a
    target of the same pipeline scales from that V and not from the one the model finds fastest at
    the target's microbatch count."""
    stated = anchor.values.get("virtual_stages")
    return anchor.values | {"virtual_stages": stated or own.config.virtual_stages}


def pipeline_settings(target: dict, measured: dict) -> dict:
    """What a target layout with a pipeline takes from the anchor's pipeline where the target's
    settings leave it open: the schedule, for any pipeline, and the virtual stages, for one of the
    anchor's depth (its V splits those layers). The stack runs its pipeline as it ran when measured,
    the schedule whose rate the anchor pins, rather than the one the model would rank fastest
    (docs/planner.md, "What the anchor pins"). `target` and `measured`: request.SETTINGS values."""
    if target.get("layout") is None or measured.get("layout") is None:
        return {}
    depth = parse_layout(str(target["layout"])).pp
    measured_depth = parse_layout(str(measured["layout"])).pp
    if depth == 1 or measured_depth == 1:
        return {}
    taken = {}
    if target.get("schedule") is None and measured.get("schedule"):
        taken["schedule"] = measured["schedule"]
    schedule = target.get("schedule") or taken.get("schedule")
    open_stages = target.get("virtual_stages") is None and (measured.get("virtual_stages") or 1) > 1
    if depth == measured_depth and schedule == measured.get("schedule") and open_stages:
        taken["virtual_stages"] = measured["virtual_stages"]
    return taken


@dataclass(frozen=True)
class Anchored:
    """Plans of a request, anchored: `plans` with the pinned terms, in the search's order;
    `own`, the anchor's own configuration with them (its step the measured one: what the plans'
    intervals spread from, fourd.plan.intervals.anchored_spread)."""

    anchor: Anchor
    pinned: Pinned
    plans: list[Plan]
    request: request.Request
    own: Plan
    taken: tuple[str, ...] = ()  # the settings the target took from the anchor (target_request)


def anchored_plans(args) -> Anchored:
    anchor = load_anchor(args.anchor)
    modelled = own_plan(anchor)
    pinned = pin(anchor, modelled)
    req, taken = target_request(args, anchor, modelled)
    found = [predict(plan, pinned) for plan in request.plans(req)]
    found.sort(key=ranked)
    return Anchored(anchor, pinned, found, req, predict(modelled, pinned), taken)


def anchor_json(result: Anchored) -> dict:
    """`--json`'s anchor block: the file, what it measured, what it pins, which terms came from
    where."""
    anchor, pinned = result.anchor, result.pinned
    anchored, modelled = terms(pinned)
    out = {
        "file": anchor.path,
        "stack": anchor.stack,
        "cluster": anchor.cluster.name,
        "measured_step_time_s": anchor.step_time_s,
        "modelled_step_time_s": pinned.modelled_s,
        "compute_rate_ratio": pinned.rate,
        "far_from_model": far_from_model(pinned),
        "per_step_cost_s": pinned.step_cost_s,
        "memory_overhead_gb": pinned.memory_overhead_gb,
        "settings_from_anchor": list(result.taken),
    }
    return {"anchor": out, "anchored_terms": anchored, "modelled_terms": modelled}


def unanchored_step(plan: Plan) -> float:
    """Seconds per step the model alone gives an anchored plan's configuration (`--json`'s
    `unanchored_step_time_s`): how far the anchor moved the prediction."""
    return evaluate(plan.job).step.step_s


def anchor_lines(result: Anchored) -> list[str]:
    """The text report's anchor section."""
    anchor, pinned = result.anchor, result.pinned
    anchored, modelled = terms(pinned)
    plan = result.plans[0]
    alone = unanchored_step(plan)
    lines = [
        "",
        f"Anchored on {anchor.path} ({anchor.stack} stack, {anchor.cluster.name}): measured "
        f"{anchor.step_time_s:.4g} s per step, the planner's model of that run "
        f"{pinned.modelled_s:.4g} s",
        f"  the stack's local work runs at {pinned.rate:.3f} × the model's time",
        f"  the model alone gives the first plan {alone:.4g} s per step; the anchor moves it "
        f"{100 * (plan.step.step_s / alone - 1):+.1f} %",
    ]
    if far_from_model(pinned):
        lines.append(
            f"  that is more than {FAR_RATE:g} times off the model: check the measurement (memory "
            "pressure, a slow kernel, the layout it names); the prediction carries all of it to the "
            "target"
        )
    if pinned.step_cost_s is not None:
        lines.append(
            f"  per-step cost beyond the microbatches: {pinned.step_cost_s:.4g} s (measured)"
        )
    if pinned.memory_overhead_gb is not None:
        lines.append(f"  memory the model misses per GPU: {pinned.memory_overhead_gb:+.2f} GB")
    lines += [
        f"  from the anchor: {', '.join(anchored)}",
        f"  from the model: {', '.join(modelled)}",
    ]
    if result.taken:
        lines.append(f"  settings as the anchor ran: {', '.join(result.taken)}")
    return lines


def run_plan(args) -> int:
    """`fourd plan --anchor FILE`: as `fourd plan`, with the anchor's pinned terms and anchored
    intervals."""
    from fourd.plan import intervals
    from fourd.plan.report import plan_report, search_json, search_report

    result = anchored_plans(args)
    found, tokens, stack = result.plans, result.request.train_tokens, result.anchor.stack
    ranking = Ranking.of(found, args.top)
    own = result.own
    extra = anchor_json(result)
    if args.json:

        def one(plan: Plan) -> dict:
            alone = {"unanchored_step_time_s": unanchored_step(plan)}
            return plan.to_json(tokens) | intervals.json_keys(plan, own, stack) | alone

        if args.search:
            body = search_json([one(plan) for plan in ranking.plans], ranking)
            body |= {"too_close_to_call": intervals.too_close(found, own, stack)}
        else:
            body = one(found[0])
        print(json.dumps(body | extra))
        return 0
    text = search_report(ranking, tokens) if args.search else plan_report(found[0], tokens)
    lines = intervals.report_lines(found[0], own, stack)
    if args.search:
        lines += intervals.search_lines(ranking.plans, own, stack)
    print("\n".join([text, *lines, *anchor_lines(result)]))
    return 0


def anchor_sim(out: dict, plan: Plan) -> dict:
    """`fourd sim step --anchor`: the simulated step of `plan` (an anchored plan; the simulator
    schedules the model's own times) carried over by the anchored planner's ratio to the unanchored
    planner's,

        T_sim,anchored = T_sim · T_plan,anchored / T_plan,model

    so what the simulator adds to the planner's closed forms (links shared, stragglers, the
    schedule's exact order) stays, on the anchor's rate. Throughput and MFU follow the anchored
    step."""
    modelled = unanchored_step(plan)
    step = out["step_time_s"] * plan.step.step_s / modelled
    factor = out["step_time_s"] / step
    return out | {
        "step_time_s": step,
        "unanchored_step_time_s": out["step_time_s"],
        "tokens_per_s": out["tokens_per_s"] * factor,
        "tflops_per_gpu": out["tflops_per_gpu"] * factor,
        "mfu": out["mfu"] * factor,
        "anchored": True,
    }
