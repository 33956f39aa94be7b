"""Prediction intervals: the conformal half-width, the groups and their fallback, the `--json` keys and the
reports, leave-one-source-out coverage, and the committed table against the suite it is generated from."""

import json
import math
import sys

import pytest
from conftest import ROOT

from fourd.cli import main
from fourd.plan import intervals
from fourd.plan.intervals import Group, groups_of, half_width, lookup

sys.path[:0] = [str(ROOT / "benchmarks")]
from validation import anchored  # noqa: E402
from validation.runs import load  # noqa: E402

ROW = [
    "plan",
    "--model=llama3-405b",
    "--cluster=llama3-h100",
    "--layout=tp=8,pp=16,dp=64",
    "--seq=8192",
    "--global-batch-tokens=16M",
    "--schedule=interleaved",
]


def test_the_half_width_is_the_conformal_rank():
    residuals = [0.01 * k for k in range(1, 11)]  # 10 rows: the ⌈11·0.8⌉ = 9th smallest
    assert half_width(residuals) == pytest.approx(0.09)
    assert half_width([-0.3, 0.1, 0.2]) == pytest.approx(
        0.3
    )  # too few rows for the rank: the largest
    assert half_width([]) == math.inf


def _row(source, residual, gen="A100", stack="fsdp", size="node", anchored=False):
    return {
        "source": source,
        "quantity": "time",
        "anchored": anchored,
        "generation": gen,
        "stack": stack,
        "scale": size,
        "residual": residual,
    }


def test_small_groups_fall_back_to_wider_ones():
    rows = [_row("a", 0.01 * k) for k in range(1, 9)]  # 8 A100 rows: their own group
    rows += [_row("b", 0.5, gen="H100") for _ in range(3)]  # 3 H100 rows: too few alone
    groups = groups_of(rows)
    a100 = lookup(groups, "time", False, "A100", "fsdp", "node")
    assert (a100.generation, a100.stack, a100.scale, a100.rows) == ("A100", "fsdp", "node", 8)
    h100 = lookup(groups, "time", False, "H100", "fsdp", "node")
    assert (h100.generation, h100.rows) == ("*", 11)
    # anchored with no anchored rows: the unanchored groups
    assert lookup(groups, "time", True, "A100", "fsdp", "node") == a100


def test_coverage_leaves_each_rows_own_source_out():
    # source "odd" is far off; judged without its own rows its interval is the others' narrow one
    rows = [_row(f"s{k}", 0.01 * (k + 1)) for k in range(10)]
    rows += [_row("odd", 0.4), _row("odd", -0.4)]
    judged = {(r["source"], r["residual"]): r for r in anchored.coverage(rows)}
    odd = judged[("odd", 0.4)]
    others = [r["residual"] for r in rows if r["source"] != "odd"]
    assert odd["half_width"] == pytest.approx(half_width(others)) and not odd["inside"]
    # a row of the others: its group has odd's rows and not its own
    first = judged[("s0", 0.01)]
    assert first["half_width"] == pytest.approx(half_width([r["residual"] for r in rows[1:]]))
    assert first["inside"]


def test_json_carries_every_interval(capsys):
    assert main([*ROW, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    group = lookup(list(intervals.table()[1]), "time", False, "H100", "*", "large")
    low, high = out["step_time_s_interval"]
    assert low == pytest.approx(out["step_time_s"] * math.exp(-group.half_width))
    assert high == pytest.approx(out["step_time_s"] * math.exp(group.half_width))
    assert out["mfu_interval"][0] == pytest.approx(out["mfu"] * out["step_time_s"] / high)
    mem_low, mem_high = out["memory_gb_interval"]
    assert mem_low < out["peak_memory_gb"] < mem_high
    assert out["interval_level"] == 0.8


def test_search_shows_each_candidates_interval_and_when_the_best_two_overlap(capsys):
    search = ["plan", "--model=llama3-8b", "--cluster=dgx-h100", "--gpus=64", "--seq=8192"]
    assert main([*search, "--global-batch-tokens=1M", "--search", "--top=3"]) == 0
    text = capsys.readouterr().out
    assert "Step-time intervals of the candidates (80 %), in the order above" in text
    assert len([line for line in text.splitlines() if " s .. " in line]) == 3
    assert main([*search, "--global-batch-tokens=1M", "--search", "--top=3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    a, b = (c["step_time_s_interval"] for c in out["candidates"][:2])
    assert out["too_close_to_call"] == (a[0] <= b[1] and b[0] <= a[1])
    assert ("too close to call" in text) == out["too_close_to_call"]


def test_the_text_report_shows_the_intervals(capsys):
    assert main(ROW) == 0
    text = capsys.readouterr().out
    assert "Intervals (80 %, from the validation suite's unanchored out-of-sample rows)" in text
    assert "  step time " in text and "  MFU " in text and "  peak memory " in text


def test_the_committed_table_is_the_suites():
    """intervals.toml is what benchmarks/validation/anchored.py --write-intervals writes from the suite as
    the model stands: after a model change, regenerate it."""
    _, runs = load()
    fresh = groups_of(anchored.residual_rows([r for r in runs if not r.excluded]))
    committed = intervals.table()[1]
    assert [(g.quantity, g.anchored, g.generation, g.stack, g.scale, g.rows) for g in fresh] == [
        (g.quantity, g.anchored, g.generation, g.stack, g.scale, g.rows) for g in committed
    ]
    for new, old in zip(fresh, committed):
        assert old.half_width == pytest.approx(new.half_width, abs=1e-5)
    assert all(isinstance(g, Group) for g in committed)


def test_the_labs_planner_panel_carries_the_intervals():
    from fourd.lab import api

    query = {"model": "llama3-8b", "cluster": "dgx-h100", "gpus": "8", "seq": "8192"}
    plan = api.plan(query | {"global_batch_tokens": "1M"})["plan"]
    low, high = plan["step_time_s_interval"]
    assert low < plan["step_time_s"] < high and plan["mfu_interval"][0] < plan["mfu"]
