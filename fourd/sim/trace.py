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
    if args:
        out["args"] = args
    return out


def label(pid: int, tid: int | None, name: str) -> dict:
    """A process name (tid None) or a thread name."""
    if tid is None:
        kind = {"name": "process_name", "pid": pid}
    else:
        kind = {"name": "thread_name", "pid": pid, "tid": tid}
    return {"ph": "M", **kind, "args": {"name": name}}


def chrome_trace(result: StepResult) -> dict:
    """Process 0 the replicas that stand for all, process 1 the straggler's; thread 2·rank a rank's
    compute, 2·rank + 1 its sends."""
    out = []
    classes = [(0, result.events, "replicas (all alike)")]
    if result.slow_events:
        classes.append((1, result.slow_events, "the straggler's replica"))
    for pid, events, name in classes:
        out.append(label(pid, None, name))
        for rank, rank_events in enumerate(events):
            out += [
                label(pid, 2 * rank, f"rank {rank} compute"),
                label(pid, 2 * rank + 1, f"rank {rank} sends"),
            ]
            out += [
                span(
                    pid,
                    2 * rank,
                    f"{event.kind}{event.stage}.{event.microbatch}",
                    NAMES[event.kind],
                    event.start,
                    event.end - event.start,
                    stage=event.stage,
                    microbatch=event.microbatch,
                )
                for event in rank_events
            ]
    out += [
        span(
            transfer.replica,
            2 * transfer.rank + 1,
            transfer.name,
            transfer.kind,
            transfer.start,
            transfer.end - transfer.start,
        )
        for transfer in result.transfers
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
    if not isinstance(result, dict):
        result = chrome_trace(result)
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
