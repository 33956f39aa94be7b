"""One prepare shared by N tasks (a Slurm array, any executor): task I prepares a contiguous share
of the sources into DIR/task-I-of-N, and `fourd data merge DIR` joins the shares into one dataset
whose stream is the one a single task would have written (docs/data.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fourd.data.prepare import FORMAT, MANIFEST, VERSION, totals, write_json
from fourd.data.sources import Source
from fourd.errors import FourdError


def task_folder(out: Path, task: int, tasks: int) -> Path:
    return out / f"task-{task:05d}-of-{tasks:05d}"


def task_sources(sources: list[Source], task: int, tasks: int) -> list[Source]:
    """Task `task`'s share: the sources whose first byte lies in its 1/tasks of the corpus's bytes,
    so the shares are contiguous, in order, and about equal in size (a file is never split)."""
    total = sum(s.size for s in sources) or 1
    share, before = [], 0
    for source in sources:
        owner = min(before * tasks // total, tasks - 1)
        if owner == task:
            share.append(source)
        before += source.size
    return share


def merge(out: Path, holdout_fraction: float) -> dict:
    """Join the task folders under `out` into one dataset: a manifest over their shards."""
    found = sorted(p for p in out.glob("task-*-of-*") if p.is_dir())
    if not found:
        raise FourdError(
            f"{out}: no task-I-of-N folders: run `fourd data prepare --task I --tasks N`"
        )
    tasks = int(found[0].name.split("-of-")[1])
    manifests = []
    for task in range(tasks):
        folder = out / f"task-{task:05d}-of-{tasks:05d}"
        try:
            manifests.append(json.loads((folder / MANIFEST).read_text()))
        except (OSError, ValueError):
            raise FourdError(
                f"{folder}: not finished (no {MANIFEST}): run task {task} of {tasks} again, "
                "then merge"
            ) from None
    first = manifests[0]
    for task, manifest in enumerate(manifests):
        for field in ("tokenizer", "eod", "vocab_size", "dtype", "text_field"):
            if manifest[field] != first[field]:
                raise FourdError(
                    f"{out}: task {task} has another {field} than task 0: prepare them alike"
                )
    shards = []
    for task, manifest in enumerate(manifests):
        name = f"task-{task:05d}-of-{tasks:05d}"
        for shard in manifest["shards"]:
            if shard["documents"]:
                entry = shard | {"file": f"{name}/{shard['file']}"}
                shards.append(entry | {"index": f"{name}/{shard['index']}"})
    merged = {key: first[key] for key in ("tokenizer", "vocab_size", "dtype", "eod", "text_field")}
    merged = {"format": FORMAT, "version": VERSION, **merged}
    merged["key"] = {"tasks": [m["key"] for m in manifests]}
    merged["description"] = first["description"]
    merged["sources"] = [s for m in manifests for s in m["sources"]]
    merged["shards"] = shards
    merged |= totals(merged, holdout_fraction, out)
    if not merged["documents"]:
        raise FourdError(f"{out}: the tasks hold no text: give sources that are not empty")
    write_json(out / MANIFEST, merged)
    os.sync()
    return merged
