"""The planner against published training runs (benchmarks/validation/runs.toml): per-row and per-source
errors of step time, MFU and memory, out of sample, with llm-analysis's predictions beside fourd's.

    python benchmarks/validate_planner.py                # the tables
    python benchmarks/validate_planner.py --json         # one object (errors as fractions)
    python benchmarks/validate_planner.py --write-docs   # the tables into docs/planner.md, between its markers
    python benchmarks/validate_planner.py --fit          # refit the fitted constants on the declared fit rows
    python benchmarks/validate_planner.py --leave-source-out   # each source predicted by a fit without it

Each usable row is asked of the planner as a user would pin it: the model, the GPU's preset (the row's NIC
rate where it states one), the layout, schedule, microbatches, ZeRO stage, recomputation, sequence
parallelism, compile, the attention kernel and HSDP. What a row leaves open (virtual stages, the microbatch
size) is the planner's choice: the fastest configuration, whether or not the memory model says it fits (the
run did fit; memory is judged on the rows that publish it). Fitted numbers are fitted on the `fit = true`
rows only (`--fit`); every error below the fit rows' is out of sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from functools import cache
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from validation.runs import Run, load  # noqa: E402

from fourd.plan import block, kernels, memory, perf, request  # noqa: E402
from fourd.plan.cluster import Cluster, load_cluster  # noqa: E402
from fourd.plan.job import ATTENTION  # noqa: E402
from fourd.plan.stack import DEFAULT_STACK, preset_names  # noqa: E402

GIB = 2**30
DOCS = ROOT / "docs" / "planner.md"
MARKERS = ("<!-- validation:begin -->", "<!-- validation:end -->")
# The preset that describes each GPU of the runs; rows that state their network set the NIC rate.
PRESETS = {
    "A100-SXM-40GB": "dgx-a100-40gb",
    "A100-SXM-80GB": "selene-a100",
    "A800-SXM-80GB": "dgx-a800",
    "H100-SXM-80GB": "dgx-h100",
    "H800-SXM-80GB": "hgx-h800",
    "H100-HBM2e-96GB": "grand-teton-h100",
    "H200-SXM-141GB": "dgx-h200",
    "GB200-186GB": "dgx-gb200",
    "B200-180GB": "dgx-b200",
}
# The fitted numbers: each GPU generation's sustained GEMM efficiency (in the presets) and the model's constants.
GENERATIONS = {
    "A100": ("dgx-a100-40gb", "selene-a100", "dgx-a800"),
    "H100/H200": ("dgx-h100", "llama3-h100", "dgx-h200", "aws-p5", "hgx-h800"),
    "H100 96 GB": ("grand-teton-h100",),
    "Blackwell": ("dgx-gb200", "dgx-b200"),
}
CONSTANTS = ((kernels, "GEMM_K_OVERHEAD", 32.0),)


def cluster_for(run: Run, efficiency: dict[str, float] | None = None) -> Cluster:
    name = run.cluster or PRESETS[run.gpu]
    return _cluster(name, run.nic_gbps_per_gpu, tuple(sorted((efficiency or {}).items())))


@cache
def _cluster(name: str, nic_gbps: float, efficiency: tuple) -> Cluster:
    c = load_cluster(name)
    for gen, names in GENERATIONS.items():
        if name in names and dict(efficiency).get(gen):
            c = dataclasses.replace(
                c, gpu=dataclasses.replace(c.gpu, gemm_efficiency=dict(efficiency)[gen])
            )
    if nic_gbps:
        c = dataclasses.replace(c, network=dataclasses.replace(c.network, nic_bw_gbps=nic_gbps / 8))
    return c


def recompute(run: Run) -> str:
    """fourd's mode for the row's recomputation: torchtitan's per-op policy is `per-op` (its `selective`)."""
    return "per-op" if run.recompute_detail.startswith("torchtitan per-op") else run.recompute


def planner_stack(run: Run) -> str:
    """The planner's stack for a row: its own, or fourd's switches where the planner has no preset
    (Meta's Llama 3 stack)."""
    return run.stack if run.stack in preset_names() else DEFAULT_STACK


def predict(run: Run, efficiency: dict[str, float] | None = None):
    """fourd's plan for a row: its settings pinned, the rest the planner's fastest among the plans of
    the best memory class there is (fourd.plan.memory's ROOMY, else TIGHT, as the search ranks them;
    where none fits, the fastest of all: the planner's memory does not rule out a configuration that
    ran)."""
    lay = run.parsed_layout
    values = {
        "layout": lay,
        "gpus": run.gpus,
        "seq": run.seq,
        "global_seqs": run.global_batch_seqs,
        "schedule": run.schedule,
        "zero": run.zero,
        "recompute": recompute(run),
        "precision": run.precision,
        "sequence_parallel": run.sequence_parallel,
        "compiled": run.compiled,
        "hsdp_replicas": run.hsdp_replicas,
        "attention": run.attention_kernel if run.attention_kernel in ATTENTION else "flash",
        "pipeline_comm": run.pipeline_comm or None,
        "stack": planner_stack(run),
        "tp_overlap": run.tp_overlap,
        "dp_overlap": run.dp_overlap,
        "fused_kernels": run.fused_kernels,
        "shared_kv": run.shared_kv,
        "fused_attention": run.fused_attention or None,
        "virtual_stages": run.virtual_stages or None,
        "microbatches": run.global_batch_seqs // lay.dp // run.microbatch_seqs
        if run.microbatch_seqs
        else None,
    }
    plans = request.plans(request.resolve(run.model_config, cluster_for(run, efficiency), values))
    best_room = min(plan.room for plan in plans)
    if best_room == memory.OVERFLOWS:
        candidates = plans
    else:
        candidates = [plan for plan in plans if plan.room == best_room]
    return max(candidates, key=lambda plan: plan.tokens_per_s)


def memory_gib(plan, kind: str) -> float:
    """The plan's peak per GPU as torch reports it: allocated, or reserved (with the allocator's fragmentation)."""
    m = plan.memory
    return (m.total if kind == "allocated" else m.total + m.fragmentation) / GIB


def evaluate(runs: list[Run], efficiency: dict[str, float] | None = None) -> list[dict]:
    out = []
    for run in runs:
        plan = predict(run, efficiency)
        row = {
            "id": run.id,
            "source": run.source,
            "stack": run.stack,
            "generation": generation_of(run),
            "fit": run.fit,
            "published_s": run.step_time_s_derived,
        }
        row.update(
            predicted_s=plan.step.step_s, error=plan.step.step_s / run.step_time_s_derived - 1
        )
        if run.mfu:
            row.update(
                mfu=run.mfu, predicted_mfu=run.mfu * run.step_time_s_derived / plan.step.step_s
            )
        if run.memory_gib:
            predicted = memory_gib(plan, run.memory_kind)
            row.update(
                memory_gib=run.memory_gib,
                predicted_gib=predicted,
                memory_error=predicted / run.memory_gib - 1,
            )
        c = plan.config
        row["config"] = (
            f"{c.schedule} V={c.virtual_stages} m={c.microbatches} ZeRO {c.zero} {c.recompute}"
        )
        out.append(row)
    return out


class GroupBias(NamedTuple):
    """A group of held-out rows (a stack's, a GPU generation's) and their mean signed error: a bias
    that a mean absolute error hides (negative: the planner too fast)."""

    rows: int
    mean_signed_error: float


def signed_means(held: list[dict], key: str) -> dict[str, GroupBias]:
    """The held-out rows' GroupBias by `key` ("stack" or "generation")."""
    groups: dict[str, list[float]] = {}
    for row in held:
        groups.setdefault(row[key], []).append(row["error"])
    return {
        name: GroupBias(len(errors), statistics.mean(errors))
        for name, errors in sorted(groups.items())
    }


def summary(rows: list[dict], sources: int) -> dict:
    held = [r for r in rows if not r["fit"]]
    per_source: dict[str, list[float]] = {}
    for r in held:
        per_source.setdefault(r["source"], []).append(abs(r["error"]))
    memory_rows = [abs(r["memory_error"]) for r in held if "memory_error" in r]
    source_means = {src: statistics.mean(errors) for src, errors in per_source.items()}
    return {
        "rows": len(rows),
        "sources": sources,
        "fit_rows": len(rows) - len(held),
        "out_of_sample_mean": statistics.mean(abs(r["error"]) for r in held),
        "out_of_sample_max": max(abs(r["error"]) for r in held),
        "fit_mean": statistics.mean(abs(r["error"]) for r in rows if r["fit"]),
        "memory_mean": statistics.mean(memory_rows) if memory_rows else None,
        # each source weighs one: a source of many rows does not carry the figure
        "out_of_sample_source_mean": statistics.mean(source_means.values()),
        "per_source": source_means,
        "signed_by_stack": signed_means(held, "stack"),
        "signed_by_generation": signed_means(held, "generation"),
    }


def _forget() -> None:
    """Drop the time and memory model's caches: a fitted constant changed under them."""
    for mod in (kernels, perf, memory, block):
        for f in vars(mod).values():
            if hasattr(f, "cache_clear"):
                f.cache_clear()


def fit(runs: list[Run]) -> dict:
    """Coordinate descent of the fitted numbers on the fit rows: mean |log(predicted / published)| of the step
    time, each number searched over a grid around its value that narrows every round; then the allocator's
    fragmentation from the fit rows that publish reserved memory."""
    rows = [r for r in runs if r.fit]
    eff = {gen: load_cluster(names[0]).gpu.gemm_efficiency for gen, names in GENERATIONS.items()}
    knobs: list = [(eff, gen, 0.04) for gen in eff] + [
        (vars(mod), name, step) for mod, name, step in CONSTANTS
    ]

    def loss() -> float:
        _forget()
        return statistics.mean(
            abs(math.log(predict(r, eff).step.step_s / r.step_time_s_derived)) for r in rows
        )

    best = loss()
    for _ in range(5):
        for i, (owner, name, step) in enumerate(knobs):
            start = owner[name]
            for value in (start + k * step for k in range(-4, 5)):
                if value >= 0 and value != start:
                    owner[name] = value
                    trial = loss()
                    if trial < best - 1e-9:
                        best, start = trial, value
            owner[name] = start
            knobs[i] = (owner, name, step / 3)
    memory.ALLOCATOR_FRAGMENTATION = 0.0
    _forget()
    reserved = [r for r in rows if r.memory_kind == "reserved"]
    frag = (
        statistics.mean(r.memory_gib / (predict(r, eff).memory.total / GIB) - 1 for r in reserved)
        if reserved
        else 0.0
    )
    out = {f"gemm_efficiency {gen}": round(v, 4) for gen, v in eff.items()}
    out.update({name: round(getattr(mod, name), 4) for mod, name, _ in CONSTANTS})
    return {**out, "ALLOCATOR_FRAGMENTATION": round(frag, 4), "fit_mean": best}


def _fitted_state() -> dict:
    """The fitted module constants as they stand (fit() changes them in place)."""
    owners = [(mod, name) for mod, name, _ in CONSTANTS] + [(memory, "ALLOCATOR_FRAGMENTATION")]
    return {(mod, name): getattr(mod, name) for mod, name in owners}


def _restore(state: dict) -> None:
    """Put back the constants `_fitted_state` read, and drop the caches computed with others."""
    for (mod, name), value in state.items():
        setattr(mod, name, value)
    _forget()


def _refit_errors(fit_on: list[Run], judged: list[Run]) -> dict[str, float]:
    """Step-time errors of the `judged` rows with every fitted number refitted on the fit rows of
    `fit_on`; the module's constants are put back afterwards."""
    state = _fitted_state()
    try:
        numbers = fit(fit_on)
        efficiency = {gen: numbers[f"gemm_efficiency {gen}"] for gen in GENERATIONS}
        return {
            run.id: predict(run, efficiency).step.step_s / run.step_time_s_derived - 1
            for run in judged
        }
    finally:
        _restore(state)


def generation_of(run: Run) -> str:
    """The fitted GPU generation (GENERATIONS) of a row's cluster."""
    name = run.cluster or PRESETS[run.gpu]
    return next(gen for gen, names in GENERATIONS.items() if name in names)


def leave_source_out(runs: list[Run]) -> dict:
    """Every source with fit rows judged by the numbers fitted without them: its rows (fit rows
    included) predicted after `fit` on the other sources' fit rows, beside the same rows after `fit`
    on all of them. The other sources' rows were never in the fit, so both leave them as they are.
    A source whose GPU generation has no fit row elsewhere cannot be judged so (its GPU's efficiency
    would keep the value its own rows gave) and is named apart.

        leave-source-out mean = mean over all rows of |error|, each row's fit without its source"""
    fitted_sources = sorted({run.source for run in runs if run.fit})
    rows_of = {source: [run for run in runs if run.source == source] for source in fitted_sources}
    with_all = _refit_errors(runs, runs)
    left_out: dict[str, float] = {}
    not_judged: list[str] = []
    for source in fitted_sources:
        others = [
            dataclasses.replace(run, fit=False) if run.source == source else run for run in runs
        ]
        fitted_elsewhere = {generation_of(run) for run in others if run.fit}
        if any(generation_of(run) not in fitted_elsewhere for run in rows_of[source] if run.fit):
            not_judged.append(source)
            continue
        left_out |= _refit_errors(others, rows_of[source])
    judged = [run for run in runs if run.source not in not_judged]
    per_source = {
        source: {
            "rows": len(own),
            "fit_rows": len([run for run in own if run.fit]),
            "refit_with_it": statistics.mean(abs(with_all[run.id]) for run in own),
            "refit_without_it": statistics.mean(abs(left_out[run.id]) for run in own),
        }
        for source, own in rows_of.items()
        if source not in not_judged
    }
    return {
        "rows": len(judged),
        "leave_source_out_mean": statistics.mean(
            abs(left_out.get(run.id, with_all[run.id])) for run in judged
        ),
        "refit_with_all_mean": statistics.mean(abs(with_all[run.id]) for run in judged),
        "per_source": per_source,
        "not_judged": not_judged,
    }


def leave_source_out_text(result: dict) -> str:
    """`leave_source_out`'s result as the table and sentences docs/planner.md quotes."""
    out = [
        "| source | rows | of them fit rows | refit with its rows | refit without them |",
        "|---|---|---|---|---|",
    ]
    for source, row in result["per_source"].items():
        out.append(
            f"| {source} | {row['rows']} | {row['fit_rows']} | "
            f"{100 * row['refit_with_it']:.1f} % | {100 * row['refit_without_it']:.1f} % |"
        )
    out.append(
        f"\nEvery row predicted by numbers fitted without its source: mean abs. error "
        f"**{100 * result['leave_source_out_mean']:.1f} %** over {result['rows']} rows (fit rows "
        f"included; {100 * result['refit_with_all_mean']:.1f} % with one fit on all fit rows)."
    )
    if result["not_judged"]:
        out.append(
            f"Not judged so: {', '.join(result['not_judged'])} (no fit row of its GPU elsewhere)."
        )
    return "\n".join(out)


def llm_analysis(runs: list[Run]) -> dict[str, float]:
    """llm-analysis's step time for the rows it can express ({} when it is not installed)."""
    try:
        from validation.llm_analysis_side import predict as theirs
    except ImportError:
        return {}
    return theirs(runs)


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f} %"


def tables(rows: list[dict], s: dict, other: dict[str, float], runs: list[Run]) -> str:
    by_id = {r.id: r for r in runs}
    out = [
        "| row | source | fit | published s | fourd s | error | MFU published / fourd | memory GiB published / fourd "
        "| llm-analysis s (error) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f} / {100 * r['predicted_mfu']:.1f} %" if "mfu" in r else ""
        mem = (
            f"{r['memory_gib']:.1f} / {r['predicted_gib']:.1f} ({_pct(r['memory_error'])})"
            if "memory_gib" in r
            else ""
        )
        theirs = other.get(r["id"])
        la = (
            f"{theirs:.4g} ({_pct(theirs / by_id[r['id']].step_time_s_derived - 1)})"
            if theirs
            else ""
        )
        out.append(
            f"| {r['id']} | {r['source']} | {'fit' if r['fit'] else ''} | {r['published_s']:.4g} | "
            f"{r['predicted_s']:.4g} | {_pct(r['error'])} | {mfu} | {mem} | {la} |"
        )
    out += ["", "| source | held-out rows | mean abs. error |", "|---|---|---|"]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["source"]] = counts.get(r["source"], 0) + (not r["fit"])
    out += [f"| {src} | {counts[src]} | {100 * v:.1f} % |" for src, v in s["per_source"].items()]
    for key, title in (("stack", "stack"), ("generation", "GPU generation")):
        out += ["", f"| {title} | held-out rows | mean signed error |", "|---|---|---|"]
        out += [
            f"| {name} | {bias.rows} | {_pct(bias.mean_signed_error)} |"
            for name, bias in s[f"signed_by_{key}"].items()
        ]
    out += [
        "",
        f"{s['rows']} rows from {s['sources']} sources, {s['fit_rows']} fit rows (mean abs. error {100 * s['fit_mean']:.1f} %). "
        f"Out of sample: mean abs. error **{100 * s['out_of_sample_mean']:.1f} %**, max {100 * s['out_of_sample_max']:.1f} %, "
        f"mean over sources {100 * s['out_of_sample_source_mean']:.1f} %; "
        f"memory rows {100 * (s['memory_mean'] or 0):.1f} % mean abs. error.",
    ]
    if other:
        errs = [
            abs(other[r["id"]] / by_id[r["id"]].step_time_s_derived - 1)
            for r in rows
            if r["id"] in other
        ]
        out.append(
            f"llm-analysis 0.2.2 (its defaults) on the {len(errs)} rows it can express: mean abs. error "
            f"{100 * statistics.mean(errs):.1f} %."
        )
    else:
        out.append(
            "llm-analysis is not installed here: `pip install --no-deps llm-analysis==0.2.2 fire==0.5.0 six termcolor`."
        )
    return "\n".join(out)


def first_predictions(runs: list[Run], now: dict[str, float]) -> dict:
    """The pre-registered first predictions (docs/planner.md, "First predictions (pre-registered)"): the
    mean of |first_prediction_s / step_time_s_derived - 1| over every row that records one and per source,
    first_prediction_s being the step time the planner gave before it changed for that source; and, for the
    same rows, the mean abs. error of the model as it is now (`now`: each row's error)."""
    then: dict[str, list[float]] = {}
    later: dict[str, list[float]] = {}
    for run in runs:
        if run.first_prediction_s:
            error = run.first_prediction_s / run.step_time_s_derived - 1
            then.setdefault(run.source, []).append(abs(error))
            later.setdefault(run.source, []).append(abs(now[run.id]))
    every = [e for errors in then.values() for e in errors]
    return {
        "first_prediction_mean": statistics.mean(every) if every else None,
        "first_prediction_rows": len(every),
        "first_prediction_per_source": {src: statistics.mean(v) for src, v in then.items()},
        "first_prediction_rows_now": {src: statistics.mean(v) for src, v in later.items()},
        "first_prediction_source_rows": {src: len(v) for src, v in then.items()},
    }


def first_prediction_text(first: dict, sources: dict) -> str:
    """The first predictions per source beside the model as it is now, for the text output."""
    out = [
        "",
        "| pre-registered source | rows | first predicted | first prediction | now |",
        "|---|---|---|---|---|",
    ]
    for src, then in first["first_prediction_per_source"].items():
        out.append(
            f"| {src} | {first['first_prediction_source_rows'][src]} | "
            f"{sources[src].first_prediction} | {100 * then:.1f} % | "
            f"{100 * first['first_prediction_rows_now'][src]:.1f} % |"
        )
    if first["first_prediction_rows"]:
        out.append(
            f"\nFirst predictions on {first['first_prediction_rows']} rows: mean abs. error "
            f"{100 * first['first_prediction_mean']:.1f} %."
        )
    return "\n".join(out)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    head, _, rest = doc.partition(MARKERS[0])
    _, _, tail = rest.partition(MARKERS[1])
    if not rest:
        raise SystemExit(f"{DOCS} has no {MARKERS[0]} ... {MARKERS[1]} section")
    DOCS.write_text(f"{head}{MARKERS[0]}\n{text}\n{MARKERS[1]}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--write-docs", action="store_true", help="write the tables into docs/planner.md"
    )
    ap.add_argument(
        "--fit", action="store_true", help="refit the fitted numbers on the fit rows and print them"
    )
    ap.add_argument(
        "--leave-source-out",
        action="store_true",
        help="judge each source with fit rows by a fit without them (about a minute)",
    )
    args = ap.parse_args()
    sources, runs = load()
    usable = [r for r in runs if not r.excluded]
    if args.fit:
        print(json.dumps(fit(usable), indent=1))
        return
    if args.leave_source_out:
        print(leave_source_out_text(leave_source_out(usable)))
        return
    rows = evaluate(usable)
    s = summary(rows, len({r.source for r in usable}))
    other = llm_analysis(usable)
    first = first_predictions(usable, {r["id"]: r["error"] for r in rows})
    if args.json:
        s.update(first)
        s["llm_analysis"] = other
        s["row_errors"] = {r["id"]: r["error"] for r in rows}
        # anchored predictions and interval coverage (validation/anchored.py)
        from validation.anchored import summary as anchored_summary

        s |= anchored_summary(usable)
        print(json.dumps(s))
        return
    text = tables(rows, s, other, usable)
    print(text)
    print(first_prediction_text(first, sources))
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
