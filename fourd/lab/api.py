"""The lab's JSON API: each endpoint checks its query parameters (FourdError, answered with HTTP
400) and shapes for the page what fourd's schedules, simulator, layouts and planner compute; no rule
lives here."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from fourd.errors import FourdError
from fourd.layout import DIMS, parse_layout
from fourd.model.config import PRESETS, get_preset
from fourd.plan import cluster as clusters
from fourd.plan import intervals, request
from fourd.plan.memory import rank_memories
from fourd.plan.report import why
from fourd.plan.stack import DEFAULT_STACK, preset_names
from fourd.schedules import SCHEDULES, build_schedule
from fourd.sim.step import UNIT, idle_fractions, simulate_step, timeline
from fourd.sim.trace import chrome_trace

P_RANGE, M_RANGE, V_RANGE = (1, 16), (1, 64), (1, 8)  # the bench's sliders
# One Llama 3 405B replica, tp=8 × pp=16 (Llama 3 paper, Table 4), drawn as 8 racks of 2 servers of
# 8 GPUs.
REPLICA_GPUS = 128
TRACE_MAX_BYTES = 64 << 20
# the row counts every group of every dimension; bounded so a request stays quick
MAX_ROW_GPUS = 1 << 20
# A simulated trace's compute pieces (microbatches × layers × passes): the step simulator runs about
# 13,000 a second on this project's 2-core machine under load (8,064 pieces in 0.6 s, 2026-12-01),
# so
# a trace stays within the lab's 2 s a request.
MAX_SIM_PIECES = 10_000


def single_values(pairs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs:
        if key in out:
            raise FourdError(f"parameter {key!r} is given twice; give it once")
        out[key] = value
    return out


def _known(q: dict[str, str], *names: str) -> None:
    for key in q:
        if key not in names:
            raise FourdError(f"unknown parameter {key!r}; this endpoint takes {', '.join(names)}")


def _int(q: dict[str, str], name: str, lo: int, hi: int, default: int | None = None) -> int:
    text = q.get(name, "")
    if text == "":
        if default is None:
            raise FourdError(f"missing parameter {name}: give an integer from {lo} to {hi}")
        return default
    if not re.fullmatch(r"[0-9]{1,9}", text):
        raise FourdError(
            f"{name}={text[:40]!r} is not a whole number: give an integer from {lo} to {hi}"
        )
    value = int(text)
    if not lo <= value <= hi:
        raise FourdError(f"{name}={value} is out of range: give an integer from {lo} to {hi}")
    return value


def _choice(q: dict[str, str], name: str, choices, default: str | None = None) -> str:
    value = q.get(name, "") or default
    if value not in choices:
        shown = "(missing)" if not value else repr(value[:40])
        raise FourdError(f"{name}={shown}: choose one of {', '.join(choices)}")
    return str(value)


def schedule(q: dict[str, str], **_) -> dict:
    """The bench: per-GPU timelines of a schedule with no communication, forward 1 and backward 2
    units. With V stages per GPU each stage holds 1/V of its layers, so its actions take 1/V as
    long."""
    _known(q, "p", "m", "schedule", "v")
    name = _choice(q, "schedule", SCHEDULES, default="gpipe")
    p, m = _int(q, "p", *P_RANGE), _int(q, "m", *M_RANGE)
    return _bench(
        name, p, m, _int(q, "v", *V_RANGE, default=1)
    )  # build_schedule checks V against the schedule


@functools.lru_cache(
    maxsize=256
)  # a slider dragged back and forth asks for the same settings again
def _bench(name: str, p: int, m: int, v: int) -> dict:
    sched = build_schedule(name, p, m, v)
    events = timeline(sched, {k: t / v for k, t in UNIT.items()})
    step, idle = idle_fractions(events)
    busy = sum(e.end - e.start for rank in events for e in rank)
    ranks = [
        dict(
            rank=r,
            stages=sched.stages_of_rank(r),
            idle_fraction=idle[r],
            peak_in_flight=sched.peak_in_flight(r),
        )
        | {"events": [[e.kind, e.stage, e.microbatch, e.start, e.end - e.start] for e in events[r]]}
        for r in range(p)
    ]
    out = {
        "p": p,
        "m": m,
        "schedule": name,
        "v": v,
        "makespan": step,
        "idle_fraction": sum(idle) / p,
    }
    return out | {
        "speedup": busy / step,
        "ranks": ranks,
    }  # speedup: one GPU would take the whole busy time


def cluster(q: dict[str, str], **_) -> dict:
    """The cluster row: a layout's first 128 ranks (rank r on GPU r, as the planner places them)
    with the group they join in each dimension (named by its first rank), and how many groups lie
    inside one server, rack or pod."""
    _known(q, "layout", "cluster")
    layout = parse_layout(q.get("layout") or "tp=8,pp=16")
    profile = clusters.load_cluster(_profile_name(q.get("cluster") or "llama3-h100"))
    if layout.world > MAX_ROW_GPUS:
        raise FourdError(
            f"layout={layout} has {layout.world:,} GPUs: the cluster row counts at most "
            f"{MAX_ROW_GPUS:,}"
        )
    per_server, per_rack = profile.node.gpus, profile.network.gpus_per_rack
    gpus = [
        {"rank": r, "server": r // per_server, "rack": r // per_rack, "coords": c}
        | {"groups": {d: layout.rank(**{**c, d: 0}) for d in DIMS}}
        for r, c in ((r, layout.coords(r)) for r in range(min(layout.world, REPLICA_GPUS)))
    ]
    spans = {
        d: {
            "size": g.size,
            "groups": g.world // g.size,
            "levels": clusters.group_levels(g, profile),
        }
        for d, g in clusters.placement(layout).items()
    }
    shape = {"racks": REPLICA_GPUS // per_rack, "servers_per_rack": per_rack // per_server}
    out = {
        "layout": str(layout),
        "world": layout.world,
        "cluster": profile.name,
        "gpus": gpus,
        "spans": spans,
    }
    return out | shape | {"gpus_per_server": per_server}


PLAN_PARAMS: tuple[str, ...] = (
    "model",
    "cluster",
    "gpus",
    "layout",
    "schedule",
    "microbatches",
    "v",
    "seq",
)
PLAN_PARAMS += ("global_batch_tokens", "zero", "recompute", "stack")


def _best_plan(q: dict[str, str]):
    """`fourd plan` for the panel's settings, through the planner's one resolver
    (fourd.plan.request): those left out are the planner's choice (fastest that fits), defaults as
    `fourd plan` fills them."""
    _known(q, *PLAN_PARAMS)
    model = get_preset(_choice(q, "model", list(PRESETS), request.DEFAULT_MODEL))
    cluster = clusters.load_cluster(_profile_name(q.get("cluster") or request.DEFAULT_CLUSTER))
    values = {
        "virtual_stages" if k == "v" else k: v
        for k, v in q.items()
        if k not in ("model", "cluster")
    }
    if "stack" in values:  # a preset's name: a path would let any page read files here
        values["stack"] = _choice(q, "stack", preset_names(), DEFAULT_STACK)
    return request.plans(request.resolve(model, cluster, values), top=1)[0]


def plan(q: dict[str, str], **_) -> dict:
    """The planner panel: the plan, memory per GPU of each pipeline rank, and the report's
    explanations."""
    best = _best_plan(q)
    ranks = range(best.config.layout.pp)
    bars = [
        {"label": f"pipeline rank {r}", **m.gb()}
        for r, m in zip(ranks, rank_memories(best.job, ranks))
    ]
    return {
        "plan": best.to_json()
        | intervals.json_keys(best),  # and its intervals (fourd.plan.intervals)
        "memory": bars,
        "gpu_memory_gb": best.cluster.gpu.memory_gb,
        "why": why(best),
    }


def simtrace(q: dict[str, str], **_) -> dict:
    """Chrome trace of the planner panel's plan, simulated step by step with communication (`fourd
    sim step`), if its step has at most MAX_SIM_PIECES compute pieces."""
    job = _best_plan(q).job
    _check_sim_size(job)
    return chrome_trace(simulate_step(job))


def _check_sim_size(job) -> None:
    """FourdError naming the microbatches that fit when the step has more than MAX_SIM_PIECES
    pieces: microbatches × the layers of all stages × passes (forward, backward; zero-bubble splits
    backward in two), as the step simulator counts them."""
    par = job.par
    layers = sum(max(1, n) for n in job.stage_layers)
    if par.schedule == "zero-bubble":
        passes = 3
    else:
        passes = 2
    pieces = par.microbatches * layers * passes
    if pieces > MAX_SIM_PIECES:
        fitting = max(1, MAX_SIM_PIECES // (layers * passes))
        raise FourdError(
            f"the step to simulate has {par.microbatches:,} microbatches x {layers} layers x "
            f"{passes} passes = {pieces:,} compute pieces; the lab simulates at most "
            f"{MAX_SIM_PIECES:,}: give microbatches={fitting} or fewer, or run `fourd sim step` "
            "for the whole step"
        )


def _profile_name(text: str) -> str:
    # Names only: a path here would let any page that reaches the lab read files on this machine.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", text) or text.endswith(".toml"):
        raise FourdError(f"cluster={text[:40]!r}: give a cluster profile name such as llama3-h100")
    return text


def trace(q: dict[str, str], *, trace_dir: Path, **_) -> dict:
    """A Chrome trace file under the server's --trace-dir, checked and returned for the page to
    draw."""
    _known(q, "path")
    text = q.get("path", "")
    if not text:
        raise FourdError("missing parameter path: name a trace file under the lab's --trace-dir")
    if "\0" in text:
        raise FourdError("path contains a NUL byte")
    root, shown = trace_dir.resolve(), repr(text[:80])
    try:
        path = (root / text).resolve()
        if not path.is_relative_to(root):
            raise FourdError(
                f"path={shown} is outside the lab's --trace-dir; start `fourd lab --trace-dir` "
                "above it"
            )
        if path.suffix != ".json":
            raise FourdError(f"path={shown}: a trace is a Chrome trace .json file")
        if not path.is_file():
            raise FourdError(f"path={shown}: no such file under the lab's --trace-dir")
        if path.stat().st_size > TRACE_MAX_BYTES:
            raise FourdError(
                f"path={shown} is larger than {TRACE_MAX_BYTES >> 20} MiB; open a shorter trace"
            )
        doc = json.loads(path.read_bytes())
    except RecursionError:
        raise FourdError(
            f"path={shown} nests deeper than Python's JSON reader goes; a trace is Chrome trace "
            "JSON, a list of flat events"
        ) from None
    except OSError as e:
        raise FourdError(
            f"path={shown} cannot be read ({e.strerror}): name a trace file under --trace-dir"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FourdError(f"path={shown} is not JSON ({e}); a trace is Chrome trace JSON") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise FourdError(f"path={shown} has no traceEvents list; a trace is Chrome trace JSON")
    return {"path": str(path.relative_to(root)), "traceEvents": events}


def options(q: dict[str, str], **_) -> dict:
    """What the page's selectors offer: model presets, cluster profiles, software stacks, schedules
    and the bench's ranges."""
    _known(q)
    names = {
        "models": list(PRESETS),
        "clusters": clusters.preset_names(),
        "schedules": list(SCHEDULES),
        "stacks": preset_names(),
    }
    return names | {"ranges": {"p": P_RANGE, "m": M_RANGE, "v": V_RANGE}}


ENDPOINTS = {f.__name__: f for f in (options, schedule, cluster, plan, simtrace, trace)}
