"""Chrome trace JSON of a simulated step (opens in Perfetto, ui.perfetto.dev, or chrome://tracing).

One process per class of replica (the replicas that stand for all, and a straggler's), two tracks
per pipeline rank: its compute and the transfers it sends.
"""

from __future__ import annotations

import json

from fourd.sim.step import StepResult

NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}


def chrome_trace(result: StepResult) -> dict:
    out = []
    classes = [(0, result.events)] + ([(1, result.slow_events)] if result.slow_events else [])
    for pid, events in classes:
        label = "replicas (all alike)" if pid == 0 else "the straggler's replica"
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        for r, evs in enumerate(events):
            out.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": 2 * r, "args": {"name": f"rank {r} compute"}}
            )
            out.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": 2 * r + 1, "args": {"name": f"rank {r} sends"}}
            )
            for e in evs:
                out.append(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": 2 * r,
                        "name": f"{e.kind}{e.stage}.{e.microbatch}",
                        "cat": NAMES[e.kind],
                        "ts": e.start * 1e6,
                        "dur": (e.end - e.start) * 1e6,
                        "args": {"stage": e.stage, "microbatch": e.microbatch},
                    }
                )
    for t in result.transfers:
        out.append(
            {
                "ph": "X",
                "pid": t.replica,
                "tid": 2 * t.rank + 1,
                "name": t.name,
                "cat": t.kind,
                "ts": t.start * 1e6,
                "dur": (t.end - t.start) * 1e6,
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(result: StepResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(result), f)
