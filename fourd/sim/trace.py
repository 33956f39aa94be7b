"""Chrome trace JSON (Perfetto, chrome://tracing), the one writer of fourd's traces: a simulated
step has one process per class of replica (all alike, a straggler's) and per pipeline rank a compute
and a sends track."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fourd.sim.step import StepResult

NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}


def span(pid: int, tid: int, name: str, cat: str, start_s: float, dur_s: float, **args) -> dict:
    """One complete ("X") event, times in seconds."""
    out = {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "name": name,
        "cat": cat,
        "ts": start_s * 1e6,
        "dur": dur_s * 1e6,
    }
    return {**out, "args": args} if args else out


def label(pid: int, tid: int | None, name: str) -> dict:
    """A process name (tid None) or a thread name."""
    kind = (
        {"name": "process_name", "pid": pid}
        if tid is None
        else {"name": "thread_name", "pid": pid, "tid": tid}
    )
    return {"ph": "M", **kind, "args": {"name": name}}


def chrome_trace(result: StepResult) -> dict:
    out = []
    classes = [(0, result.events)] + ([(1, result.slow_events)] if result.slow_events else [])
    for pid, events in classes:
        out.append(
            label(pid, None, "replicas (all alike)" if pid == 0 else "the straggler's replica")
        )
        for r, evs in enumerate(events):
            out += [
                label(pid, 2 * r, f"rank {r} compute"),
                label(pid, 2 * r + 1, f"rank {r} sends"),
            ]
            out += [
                span(
                    pid,
                    2 * r,
                    f"{e.kind}{e.stage}.{e.microbatch}",
                    NAMES[e.kind],
                    e.start,
                    e.end - e.start,
                    stage=e.stage,
                    microbatch=e.microbatch,
                )
                for e in evs
            ]
    out += [
        span(t.replica, 2 * t.rank + 1, t.name, t.kind, t.start, t.end - t.start)
        for t in result.transfers
    ]
    return document(out)


def document(events: list[dict]) -> dict:
    """A Chrome trace document of these events."""
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(result: StepResult | dict, path: str | Path) -> None:
    """Write a step's trace (or a ready trace document) atomically: a reader never sees half a
    file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result if isinstance(result, dict) else chrome_trace(result)))
    os.replace(tmp, path)
