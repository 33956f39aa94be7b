"""Anchored predictions and prediction intervals, judged on the validation suite (runs.toml).

    python benchmarks/validation/anchored.py                    # the series, coverage and half-widths
    python benchmarks/validation/anchored.py --json             # one object (errors as fractions)
    python benchmarks/validation/anchored.py --write-intervals  # regenerate fourd/plan/intervals.toml

Anchored: every series of rows of the same model, GPU chip, source family and settings (sequence,
recomputation, ZeRO, compile, precision, kernels, HSDP) on different numbers of GPUs is anchored on its
smallest row (its published step time, as `fourd plan --anchor` takes a measured one) and predicts the others
(fourd.plan.anchor.pin and predict). Intervals: each row's out-of-sample residual, log(published /
predicted), grouped by GPU generation, stack, scale and anchoring (fourd.plan.intervals); the coverage of the
80 % interval is judged leave-one-source-out: a row's interval is computed from the other sources' rows only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]

from validate_planner import memory_gib, predict, recompute  # noqa: E402

from fourd.plan import intervals  # noqa: E402
from fourd.plan.anchor import Anchor, pin, pipeline_settings  # noqa: E402
from fourd.plan.anchor import predict as anchored_plan  # noqa: E402
from fourd.plan.intervals import Group, generation, scale, stack_family  # noqa: E402
from validation.runs import Run, load  # noqa: E402

# Sources that publish runs of one code base at different dates, or in different tables of one
# document: one family, one series.
FAMILIES = {
    "ibm-fsdp-2403": "ibm-fsdp",
    "ibm-fsdp-2405": "ibm-fsdp",
    "llmfoundry-h100-tables": "llmfoundry",
    "llmfoundry-a100-tables": "llmfoundry",
    "llmfoundry-h100-large-2401": "llmfoundry",
    "megatron-weak-h100": "megatron-readme-h100",
    "megatron-strong-h100": "megatron-readme-h100",
}
# Releases of one benchmark suite, each with its own software (never one series), whose rows are not
# independent: intervals are judged with them left out together.
RELEASES = {
    "dgxc-benchmarking-h100-2504": "dgxc-benchmarking-h100",
    **{
        f"megatron-bridge-{container}": "megatron-bridge"
        for container in ("2509", "2511", "2602", "260201", "2604", "260401", "2606")
    },
}


def left_out_with(source: str) -> str:
    """The sources a row's interval is judged without: its family or suite, as one."""
    return FAMILIES.get(source, RELEASES.get(source, source))


GPU_NAMES = {"A100-SXM-40GB": "A100", "A100-SXM-80GB": "A100", "H100-SXM-80GB": "H100"}


def chip(run: Run) -> str:
    return GPU_NAMES.get(run.gpu, run.gpu.split("-")[0])


def series(runs: list[Run]) -> list[list[Run]]:
    """Rows that differ only in their GPU count (and so in layout and microbatches), smallest first; only
    groups with at least two GPU counts."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        key = (
            run.model or run.model_spec,
            chip(run),
            FAMILIES.get(run.source, run.source),
            run.seq,
            recompute(run),
            run.zero,
            run.compiled,
            run.precision,
            run.attention_kernel,
            run.fused_attention,
            run.pipeline_comm,
            run.sequence_parallel,
            run.stack,
            run.tp_overlap,
        )
        groups.setdefault(key, []).append(run)
    out = [sorted(g, key=lambda r: r.gpus) for g in groups.values()]
    return [g for g in out if len({r.gpus for r in g}) > 1]


def _name(group: list[Run]) -> str:
    counts = " -> ".join(f"{r.gpus:,}" for r in group)
    return f"{group[0].id} ({counts} {chip(group[0])})"


def as_the_anchor_ran(run: Run, anchor_run: Run, anchor_plan) -> Run:
    """The target row as `fourd plan --anchor` plans it: the virtual stages it leaves open, the anchor's
    where its pipeline has the anchor's depth and schedule (fourd.plan.anchor.pipeline_settings; the
    anchor's own V is the one its plan ran, stated or the planner's)."""
    target = {
        "layout": run.layout,
        "schedule": run.schedule,
        "virtual_stages": run.virtual_stages or None,
    }
    measured = {
        "layout": anchor_run.layout,
        "schedule": anchor_run.schedule,
        "virtual_stages": anchor_plan.config.virtual_stages,
    }
    taken = pipeline_settings(target, measured)
    return dataclasses.replace(run, virtual_stages=taken.get("virtual_stages", run.virtual_stages))


def anchored_rows(runs: list[Run]) -> list[dict]:
    """Each series' rows beyond its smallest, predicted from the smallest row's published step time (and
    its published memory, as an additive per-GPU term, where both rows publish the same kind)."""
    out = []
    for group in series(runs):
        first, plan_a = group[0], predict(group[0])
        anchor = Anchor(
            path=first.id,
            model=first.model_config,
            cluster=plan_a.cluster,
            values={},
            step_time_s=first.step_time_s_derived,
            stack=first.stack,
        )
        pinned = pin(anchor, plan_a)
        own = anchored_plan(plan_a, pinned)
        for run in group[1:]:
            modelled_t = predict(as_the_anchor_ran(run, first, plan_a))
            plan_t = anchored_plan(modelled_t, pinned)
            shape, spread = intervals.anchored_spread(plan_t, own)
            row = {
                "id": run.id,
                "series": _name(group),
                "source": run.source,
                "anchor": first.id,
                "published_s": run.step_time_s_derived,
                "predicted_s": plan_t.step.step_s,
                "error": plan_t.step.step_s / run.step_time_s_derived - 1,
                "rate": pinned.rate,
                "shape": shape,
                "spread": spread,
            }
            if run.memory_gib and first.memory_gib and run.memory_kind == first.memory_kind:
                overhead = first.memory_gib - memory_gib(plan_a, first.memory_kind)
                predicted = memory_gib(modelled_t, run.memory_kind) + overhead
                row |= {"memory_gib": run.memory_gib, "predicted_gib": predicted}
            out.append(row)
    return out


def residual_rows(runs: list[Run]) -> list[dict]:
    """Every out-of-sample residual: held-out rows unanchored (fit rows are in the fit), every memory row
    (the memory model's one fitted number is the allocator's share), and the anchored rows."""
    out = []
    by_id = {r.id: r for r in runs}

    def row(run: Run, quantity: str, predicted: float, published: float, anchored_row=None) -> dict:
        """A residual row; `anchored_row`: the row of anchored_rows it comes from, whose shape it
        takes, and for a step time its spread."""
        out = {
            "id": run.id,
            "source": left_out_with(run.source),
            "quantity": quantity,
            "anchored": anchored_row is not None,
            "generation": generation(chip(run)),
            "stack": stack_family(run.stack),
            "scale": scale(run.gpus),
            "residual": math.log(published / predicted),
        }
        if anchored_row is not None:
            out["shape"] = anchored_row["shape"]
            out["spread"] = anchored_row["spread"] if quantity == "time" else 1.0
        return out

    for run in runs:
        plan = predict(run)
        if not run.fit:
            out.append(row(run, "time", plan.step.step_s, run.step_time_s_derived))
        if run.memory_gib:
            out.append(row(run, "memory", memory_gib(plan, run.memory_kind), run.memory_gib))
    for a in anchored_rows(runs):
        run = by_id[a["id"]]
        out.append(row(run, "time", a["predicted_s"], a["published_s"], a))
        if "memory_gib" in a:
            out.append(row(run, "memory", a["predicted_gib"], a["memory_gib"], a))
    return out


def coverage(rows: list[dict], level: float = intervals.LEVEL) -> list[dict]:
    """Leave-one-source-out: each row's interval from the groups of the other sources' rows alone (a
    family or a suite's releases left out as one), and whether the row falls inside it (rows with no
    group left get no interval and are not counted)."""
    out = []
    for source in sorted({r["source"] for r in rows}):
        groups = intervals.groups_of([r for r in rows if r["source"] != source], level)
        for r in (r for r in rows if r["source"] == source):
            keys = (r["generation"], r["stack"], r["scale"], r.get("shape", intervals.ANY))
            g = intervals.lookup(groups, r["quantity"], r["anchored"], *keys)
            if g is not None:
                width = g.width(r.get("spread", 1.0))
                out.append(r | {"half_width": width, "inside": abs(r["residual"]) <= width})
    return out


def summary(runs: list[Run]) -> dict:
    """anchored_mean, anchored_rows, per-series errors, interval_coverage and the median half-widths."""
    usable = [r for r in runs if not r.excluded]
    rows = anchored_rows(usable)
    per_series: dict[str, list[float]] = {}
    for r in rows:
        per_series.setdefault(r["series"], []).append(abs(r["error"]))
    judged = coverage(residual_rows(usable))

    def median_width(anchored: bool, quantity: str = "time") -> float | None:
        widths = [
            math.exp(r["half_width"]) - 1
            for r in judged
            if r["anchored"] == anchored and r["quantity"] == quantity
        ]
        return statistics.median(widths) if widths else None

    return {
        "anchored_mean": statistics.mean(abs(r["error"]) for r in rows),
        "anchored_rows": {r["id"]: r["error"] for r in rows},
        "anchored_series": {k: statistics.mean(v) for k, v in per_series.items()},
        "interval_level": intervals.LEVEL,
        "interval_coverage": statistics.mean(r["inside"] for r in judged),
        "interval_coverage_rows": len(judged),
        "interval_coverage_by_kind": {
            f"{q} {'anchored' if a else 'unanchored'}": statistics.mean(
                r["inside"] for r in judged if (r["quantity"], r["anchored"]) == (q, a)
            )
            for q, a in sorted({(r["quantity"], r["anchored"]) for r in judged})
        },
        "median_half_width_unanchored": median_width(False),
        "median_half_width_anchored": median_width(True),
        "median_half_width_memory": median_width(False, "memory"),
    }


def write_intervals(runs: list[Run]) -> list[Group]:
    """intervals.toml from every out-of-sample residual of the suite."""
    groups = intervals.groups_of(residual_rows([r for r in runs if not r.excluded]))
    lines = [
        "# Generated by `python benchmarks/validation/anchored.py --write-intervals` from the validation",
        "# suite's out-of-sample residuals; do not edit (docs/planner.md, Anchored predictions and intervals).",
        "# half_width: natural log, the interval is point * exp(+-half_width * spread), the spread 1 but for",
        "# anchored step times (fourd.plan.intervals.anchored_spread); '*' matches any value.",
        f"level = {intervals.LEVEL}",
    ]
    for group in groups:
        lines += [
            "",
            "[[group]]",
            f'quantity = "{group.quantity}"',
            f"anchored = {'true' if group.anchored else 'false'}",
            f'generation = "{group.generation}"',
            f'stack = "{group.stack}"',
            f'scale = "{group.scale}"',
            f'shape = "{group.shape}"',
            f"rows = {group.rows}",
            f"half_width = {group.half_width:.5f}",
        ]
    intervals.TABLE.write_text("\n".join(lines) + "\n")
    intervals.table.cache_clear()
    return groups


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def tables(runs: list[Run], s: dict) -> str:
    rows = anchored_rows([r for r in runs if not r.excluded])
    out = [
        "| series (anchor first) | row | published s | anchored s | error |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {r['series']} | {r['id']} | {r['published_s']:.4g} | {r['predicted_s']:.4g} | "
        f"{100 * r['error']:+.1f} % |"
        for r in rows
    ]
    out += ["", "| series | rows | mean abs. error |", "|---|---|---|"]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["series"]] = counts.get(r["series"], 0) + 1
    out += [f"| {k} | {counts[k]} | {_pct(v)} |" for k, v in s["anchored_series"].items()]
    kinds = ", ".join(f"{k} {_pct(v)}" for k, v in s["interval_coverage_by_kind"].items())
    out += [
        "",
        f"Anchored: mean abs. error **{_pct(s['anchored_mean'])}** over {len(rows)} rows of "
        f"{len(counts)} series, worst series {_pct(max(s['anchored_series'].values()))}.",
        f"Intervals ({100 * s['interval_level']:.0f} %), leave-one-source-out: coverage "
        f"**{_pct(s['interval_coverage'])}** of {s['interval_coverage_rows']} rows ({kinds}); median "
        f"half-width {_pct(s['median_half_width_unanchored'])} unanchored, "
        f"{_pct(s['median_half_width_anchored'])} anchored, memory {_pct(s['median_half_width_memory'])}.",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--write-intervals", action="store_true", help="regenerate fourd/plan/intervals.toml"
    )
    args = ap.parse_args()
    _, runs = load()
    if args.write_intervals:
        groups = write_intervals(runs)
        print(f"wrote {intervals.TABLE} ({len(groups)} groups)")
    s = summary(runs)
    print(json.dumps(s) if args.json else tables(runs, s))


if __name__ == "__main__":
    main()
