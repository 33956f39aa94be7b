"""The lab's JSON API: each endpoint turns query parameters into a call to fourd's own code.

Nothing here knows how a schedule orders its work or what a layout costs: the bench asks
`fourd.schedules` and `fourd.sim`, the cluster row `fourd.layout`, the planner panel
`fourd.plan`. This module only checks the parameters (bad ones raise FourdError, answered with
HTTP 400) and shapes the answers for the page.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from fourd.errors import FourdError
from fourd.layout import DIMS, parse_layout
from fourd.model.config import PRESETS, get_preset
from fourd.plan import cluster as clusters
from fourd.plan import request
from fourd.plan.memory import rank_memories
from fourd.plan.report import why
from fourd.schedules import SCHEDULES, build_schedule
from fourd.sim import pipeline
from fourd.sim.step import simulate_step
from fourd.sim.trace import chrome_trace

# The seed's bench (brief.md §1 row 14): p from 1 to 16 stages, m from 1 to 64 microbatches.
P_RANGE = (1, 16)
M_RANGE = (1, 64)
V_RANGE = (1, 8)
# One Llama 3 replica (brief.md §1 rows 1, 4): 128 GPUs, 8 racks of 2 servers of 8 GPUs.
REPLICA_GPUS = 128
TRACE_MAX_BYTES = 64 << 20


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
        raise FourdError(f"{name}={text[:40]!r} is not a whole number: give an integer from {lo} to {hi}")
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
    """The bench: per-rank timelines of a schedule with no communication, from fourd.sim.pipeline.

    Forward takes one unit and backward two, as in the seed. With V stages per GPU each stage holds
    1/V of a GPU's layers, so its actions take 1/V as long and the total work stays that of V = 1.
    """
    _known(q, "p", "m", "schedule", "v")
    name = _choice(q, "schedule", SCHEDULES, default="gpipe")
    p, m = _int(q, "p", *P_RANGE), _int(q, "m", *M_RANGE)
    v = _int(q, "v", *V_RANGE, default=1)
    if v > 1 and name != "interleaved":
        raise FourdError(f"v={v} needs schedule=interleaved ({name} runs one stage per GPU; drop v or set v=1)")
    return _bench(name, p, m, v)


@functools.lru_cache(maxsize=256)  # a slider dragged back and forth asks for the same settings again
def _bench(name: str, p: int, m: int, v: int) -> dict:
    sched = build_schedule(name, p, m, v)
    events = pipeline.timeline(sched, {k: t / v for k, t in pipeline.UNIT.items()})
    step, idle = pipeline.idle_fractions(events)
    busy = sum(e.end - e.start for rank in events for e in rank)
    return {
        "p": p,
        "m": m,
        "schedule": name,
        "v": v,
        "makespan": step,
        "idle_fraction": sum(idle) / p,
        # One GPU running every stage would take the whole busy time.
        "speedup": busy / step,
        "ranks": [
            {
                "rank": r,
                "stages": sched.stages_of_rank(r),
                "idle_fraction": idle[r],
                "peak_in_flight": sched.peak_in_flight(r),
                "events": [[e.kind, e.stage, e.microbatch, e.start, e.end - e.start] for e in events[r]],
            }
            for r in range(p)
        ],
    }


def cluster(q: dict[str, str], **_) -> dict:
    """The cluster row: which GPU each rank of a layout runs on, and the TP, CP, PP and DP group it joins.

    Placement and topology come from the planner's cluster model (ranks fill servers in order, so TP,
    the innermost dimension, stays inside a server). The row draws the first 128 ranks: one Llama 3
    replica of 8 racks, 16 servers, 128 GPUs on the llama3-h100 profile.
    """
    _known(q, "layout", "cluster")
    layout = parse_layout(q.get("layout") or "tp=8,pp=16")
    profile = clusters.load_cluster(_profile_name(q.get("cluster") or "llama3-h100"))
    groups = clusters.placement(layout)
    per_server, per_rack = profile.node.gpus, profile.network.gpus_per_rack
    gpus = []
    for rank in range(min(layout.world, REPLICA_GPUS)):
        coords = layout.coords(rank)
        # A group is named by its first member: the rank with this dimension's index at 0.
        gpus.append(
            {
                "rank": rank,
                "server": rank // per_server,
                "rack": rank // per_rack,
                "coords": coords,
                "groups": {d: layout.rank(**{**coords, d: 0}) for d in DIMS},
            }
        )
    return {
        "layout": str(layout),
        "world": layout.world,
        "cluster": profile.name,
        "racks": REPLICA_GPUS // per_rack,
        "servers_per_rack": per_rack // per_server,
        "gpus_per_server": per_server,
        "gpus": gpus,
        "spans": {
            d: {"size": g.size, "groups": layout.world // g.size, "level": clusters.group_level(g, profile)}
            for d, g in groups.items()
        },
    }


PLAN_PARAMS = (
    "model",
    "cluster",
    "gpus",
    "layout",
    "schedule",
    "microbatches",
    "v",
    "seq",
    "global_batch_tokens",
    "zero",
    "recompute",
)


def _best_plan(q: dict[str, str]):
    """`fourd plan` for the panel's settings, through the planner's one resolver (fourd.plan.request): those
    left out are the planner's choice (fastest that fits), defaults as `fourd plan` fills them."""
    _known(q, *PLAN_PARAMS)
    model = get_preset(_choice(q, "model", list(PRESETS), request.DEFAULT_MODEL))
    cluster = clusters.load_cluster(_profile_name(q.get("cluster") or request.DEFAULT_CLUSTER))
    values = {"virtual_stages" if k == "v" else k: v for k, v in q.items() if k not in ("model", "cluster")}
    return request.plans(request.resolve(model, cluster, values))[0]


def plan(q: dict[str, str], **_) -> dict:
    """The planner panel: the plan, memory per GPU of each pipeline rank, and the report's explanations."""
    best = _best_plan(q)
    ranks = range(best.config.layout.pp)
    bars = [{"label": f"pipeline rank {r}", **m.gb()} for r, m in zip(ranks, rank_memories(best.job, ranks))]
    return {"plan": best.to_json(), "memory": bars, "gpu_memory_gb": best.cluster.gpu.memory_gb, "why": why(best)}


def simtrace(q: dict[str, str], **_) -> dict:
    """Chrome trace of the planner panel's plan, simulated step by step with communication (`fourd sim step`)."""
    return chrome_trace(simulate_step(_best_plan(q).job))


def _profile_name(text: str) -> str:
    # Names only: a path here would let any page that reaches the lab read files on this machine.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", text) or text.endswith(".toml"):
        raise FourdError(f"cluster={text[:40]!r}: give a cluster profile name such as llama3-h100")
    return text


def trace(q: dict[str, str], *, trace_dir: Path, **_) -> dict:
    """A Chrome trace file under the server's --trace-dir, checked and returned for the page to draw."""
    _known(q, "path")
    text = q.get("path", "")
    if not text:
        raise FourdError("missing parameter path: the trace file, relative to the lab's --trace-dir")
    if "\0" in text:
        raise FourdError("path contains a NUL byte")
    root = trace_dir.resolve()
    path = (root / text).resolve()
    if not path.is_relative_to(root):
        raise FourdError(f"path={text!r} is outside the lab's --trace-dir; start `fourd lab --trace-dir` above it")
    if path.suffix != ".json":
        raise FourdError(f"path={text!r}: a trace is a Chrome trace .json file")
    if not path.is_file():
        raise FourdError(f"path={text!r}: no such file under the lab's --trace-dir")
    if path.stat().st_size > TRACE_MAX_BYTES:
        raise FourdError(f"path={text!r} is larger than {TRACE_MAX_BYTES >> 20} MB; open a shorter trace")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FourdError(f"path={text!r} is not JSON ({e}); a trace is Chrome trace JSON") from e
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise FourdError(f"path={text!r} has no traceEvents list; a trace is Chrome trace JSON")
    return {"path": str(path.relative_to(root)), "traceEvents": events}


def options(q: dict[str, str], **_) -> dict:
    """What the page's selectors offer: model presets, cluster profiles, schedules and the bench's ranges."""
    _known(q)
    return {
        "models": list(PRESETS),
        "clusters": clusters.preset_names(),
        "schedules": list(SCHEDULES),
        "ranges": {"p": P_RANGE, "m": M_RANGE, "v": V_RANGE},
    }


ENDPOINTS = {
    "options": options,
    "schedule": schedule,
    "cluster": cluster,
    "plan": plan,
    "simtrace": simtrace,
    "trace": trace,
}
