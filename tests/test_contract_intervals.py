"""fourd.plan.intervals by hand: the scale and generation a plan is looked up by, the conformal rank at
any level, the groups' keys and their fallback, and what a plan's intervals, the text report and
`--search` say, on a table of known half-widths (contract: `fourd plan`'s intervals)."""

import math
from types import SimpleNamespace

import pytest

from fourd.layout import parse_layout
from fourd.plan import intervals
from fourd.plan.intervals import (
    ANY,
    RESHAPED,
    SAME,
    SPREAD_FLOOR,
    Group,
    anchored_spread,
    generation,
    groups_of,
    half_width,
    lookup,
    scale,
)

LN2 = math.log(2.0)  # a half-width that doubles and halves: intervals exact in binary


def test_a_plans_scale_is_one_server_up_to_8_gpus_a_cluster_up_to_1024():
    assert [scale(gpus) for gpus in (1, 8, 9, 1024, 1025, 16384)] == [
        "node",
        "node",
        "cluster",
        "cluster",
        "large",
        "large",
    ]


def test_an_h200_is_looked_up_as_an_h100_and_other_chips_as_themselves():
    names = ("H200 SXM 141GB", "h100 PCIe", "A100 SXM 40GB", "H800 SXM 80GB", "A800 SXM4 80GB")
    assert [generation(name) for name in names] == ["H100", "H100", "A100", "H100", "A100"]
    assert (generation("cpu x86"), generation("")) == ("CPU", ANY)


def test_the_conformal_rank_moves_with_the_level():
    residuals = [-0.4, 0.1, 0.3, -0.2, 0.5]  # sorted |r|: 0.1, 0.2, 0.3, 0.4, 0.5
    assert half_width(residuals, level=0.5) == 0.3  # ⌈6 · 0.5⌉ = 3rd
    assert half_width(residuals, level=0.6) == 0.4  # ⌈6 · 0.6⌉ = 4th
    assert half_width(residuals, level=0.8) == 0.5  # ⌈4.8⌉ = 5th
    assert half_width([0.2], level=0.1) == 0.2  # ⌈0.2⌉ = 1st


def _row(quantity, anchored, gen, stack, size, residual):
    keys = ("quantity", "anchored", "generation", "stack", "scale", "residual")
    return dict(zip(keys, (quantity, anchored, gen, stack, size, residual)))


def test_every_group_at_every_width_for_each_quantity_and_anchoring():
    rows = [
        _row("time", False, "A100", "fsdp", "node", 0.1),
        _row("time", False, "H100", "fsdp", "node", -0.3),
        _row("time", True, "A100", "fsdp", "node", 0.2),
        _row("time", True, "H100", "fsdp", "cluster", -0.4),
        _row("memory", False, "A100", "fsdp", "node", 0.05),
    ]
    got = [
        (g.quantity, g.anchored, g.generation, g.stack, g.scale, g.rows, g.half_width)
        for g in groups_of(rows, level=0.5)
    ]
    assert got == [
        ("memory", False, "A100", "fsdp", "node", 1, 0.05),
        ("memory", False, "A100", "fsdp", "*", 1, 0.05),
        ("memory", False, "A100", "*", "*", 1, 0.05),
        ("memory", False, "*", "*", "*", 1, 0.05),
        ("time", False, "A100", "fsdp", "node", 1, 0.1),
        ("time", False, "H100", "fsdp", "node", 1, 0.3),
        ("time", False, "A100", "fsdp", "*", 1, 0.1),
        ("time", False, "H100", "fsdp", "*", 1, 0.3),
        ("time", False, "A100", "*", "*", 1, 0.1),
        ("time", False, "H100", "*", "*", 1, 0.3),
        ("time", False, "*", "*", "*", 2, 0.3),  # ⌈3 · 0.5⌉ = 2nd of 0.1, 0.3
        # anchored: the generation goes first (the anchor measured the GPU), then the scale
        ("time", True, "A100", "fsdp", "node", 1, 0.2),
        ("time", True, "H100", "fsdp", "cluster", 1, 0.4),
        ("time", True, "*", "fsdp", "cluster", 1, 0.4),
        ("time", True, "*", "fsdp", "node", 1, 0.2),
        ("time", True, "*", "fsdp", "*", 2, 0.4),
        ("time", True, "*", "*", "*", 2, 0.4),
    ]


def _group(quantity="time", anchored=False, key=(ANY, ANY, ANY), rows=8, width=LN2, shape=ANY):
    return Group(quantity, anchored, *key, rows=rows, half_width=width, shape=shape)


def test_the_narrowest_group_with_enough_rows_and_the_widest_down_to_three():
    narrow = _group(key=("A100", "fsdp", "node"), rows=8, width=0.1)
    thin = _group(key=("A100", "fsdp", ANY), rows=7, width=0.2)
    wide = _group(rows=3, width=0.3)
    groups = [thin, narrow, wide]
    assert lookup(groups, "time", False, "A100", "fsdp", "node") is narrow
    # a group of 7 is too few below the widest: the widest serves with 3
    assert lookup(groups, "time", False, "A100", "fsdp", "cluster") is wide
    assert lookup([thin, _group(rows=2)], "time", False, "A100", "fsdp", "cluster") is None
    assert lookup(groups, "memory", False, "A100", "fsdp", "node") is None
    # anchored: its own groups first, then the unanchored ones
    mine = _group(anchored=True, key=("A100", "fsdp", "node"), rows=8, width=0.05)
    assert lookup([*groups, mine], "time", True, "A100", "fsdp", "node") is mine
    assert lookup(groups, "time", True, "A100", "fsdp", "node") is narrow
    # unanchored never takes an anchored group
    assert lookup([mine], "time", False, "A100", "fsdp", "node") is None
    # anchored, the stack's rows on every GPU at this scale come before this GPU's rows of every stack
    same_stack = _group(anchored=True, key=(ANY, "fsdp", "node"), rows=8, width=0.06)
    same_gpu = _group(anchored=True, key=("H100", "fsdp", ANY), rows=8, width=0.07)
    any_scale = _group(anchored=True, key=(ANY, "fsdp", ANY), rows=8, width=0.08)
    pool = [same_gpu, any_scale, same_stack]
    assert lookup(pool, "time", True, "H100", "fsdp", "node") is same_stack
    assert lookup(pool, "time", True, "H100", "fsdp", "large") is any_scale
    assert lookup(pool, "time", True, "H100", "nemo", "large") is None  # no other stack's rows


def _plan(step_s=2.0, layout="tp=8,dp=8", stack="fsdp", **fields):
    """A plan as the intervals read it: MFU 40 %, 40 GB, 64 GPUs that fit, one sequence per
    microbatch, and GPU-seconds per token (gpus / tokens_per_s) of 1 ms, unless `fields` say
    otherwise."""
    values = dict(mfu=0.4, peak_gb=40.0, gpus=64, fits=True, tokens_per_s=64_000.0, micro_seqs=1)
    return SimpleNamespace(
        step=SimpleNamespace(step_s=step_s),
        job=SimpleNamespace(stack=stack),
        cluster=SimpleNamespace(gpu=SimpleNamespace(name="A100 SXM 80GB")),
        config=SimpleNamespace(layout=parse_layout(layout), virtual_stages=1),
        **(values | fields),
    )


@pytest.fixture
def halves(monkeypatch):
    """A table at 50 %: step time ×/÷ 2 for A100 fsdp rows on a cluster, memory ×/÷ e^0.25."""
    groups = (
        _group(key=("A100", "fsdp", "cluster"), width=LN2),
        _group(quantity="memory", width=0.25, rows=3),
    )
    monkeypatch.setattr(intervals, "table", lambda: (0.5, groups))


def test_a_plans_intervals_bracket_its_time_mfu_and_memory(halves):
    got = intervals.json_keys(_plan())
    assert got == {
        "step_time_s_interval": [1.0, 4.0],
        "mfu_interval": [0.2, 0.8],  # a slower step, a lower MFU
        "memory_gb_interval": [40.0 * math.exp(-0.25), 40.0 * math.exp(0.25)],
        "interval_level": 0.5,
        "peak_memory_gb": 40.0,
    }
    slower = intervals.plan_intervals(_plan(step_s=3.0))  # the MFU's bounds do not hang on 1 s
    assert slower["mfu_interval"] == pytest.approx([0.2, 0.8], rel=1e-12)
    # another stack has no time group here, and then no MFU interval either; memory still has one
    other = intervals.plan_intervals(_plan(stack="nemo"))
    assert (other["step_time_s_interval"], other["mfu_interval"]) == (None, None)
    assert other["memory_gb_interval"] == got["memory_gb_interval"]
    # the stack an anchor names wins over the plan's own
    assert intervals.plan_intervals(_plan(stack="nemo"), stack="fsdp") == intervals.plan_intervals(
        _plan()
    )


def test_without_a_memory_group_there_is_no_memory_interval(monkeypatch):
    monkeypatch.setattr(
        intervals, "table", lambda: (0.8, (_group(key=("A100", "fsdp", "cluster")),))
    )
    got = intervals.plan_intervals(_plan())
    assert got["memory_gb_interval"] is None and got["step_time_s_interval"] == [1.0, 4.0]


def test_the_text_report_prints_each_interval(halves):
    assert intervals.report_lines(_plan(), anchor=_plan()) == [
        "",
        "Intervals (50 %, from the validation suite's anchored out-of-sample rows)",
        "  step time               2 s     1 s .. 4 s",
        "  MFU                  40.0 %     20.0 % .. 80.0 %",
        f"  peak memory          40.0 GB    {40 * math.exp(-0.25):.1f} GB .. "
        f"{40 * math.exp(0.25):.1f} GB",
        "  the step time's spread 0.02: 0.02 + how far the GPU-seconds per token move from the "
        "anchor's, the anchor's per-GPU microbatch work (same)",
    ]
    assert intervals.report_lines(_plan(stack="nemo"))[2:4] == [
        "  step time               2 s     no interval (intervals.toml not written)",
        "  MFU                  40.0 %     no interval (intervals.toml not written)",
    ]


def test_the_best_two_are_too_close_to_call_only_when_their_intervals_overlap(halves):
    too_close = intervals.too_close
    # [1, 4] and [1.5, 6]; [1, 4] and [4, 16] touch; [1, 4] and [4.5, 18] do not, in either order
    assert too_close([_plan(2.0), _plan(3.0)])
    assert too_close([_plan(2.0), _plan(8.0)])
    assert not too_close([_plan(2.0), _plan(9.0)])
    assert not too_close([_plan(9.0), _plan(2.0)])
    # [4, 16] holds [3, 12]; [4, 16] touches [1, 4] from above
    assert too_close([_plan(8.0), _plan(6.0)])
    assert too_close([_plan(8.0), _plan(2.0)])
    # plans that do not fit are not among the best two; fewer than two that fit: nothing to call
    assert not too_close([_plan(2.0), _plan(3.0, fits=False), _plan(9.0)])
    assert not too_close([_plan(2.0), _plan(3.0, fits=False)])
    # either of the two without an interval: nothing to call
    assert not too_close([_plan(2.0, stack="nemo"), _plan(3.0)])
    assert not too_close([_plan(2.0), _plan(3.0, stack="nemo")])


def test_search_lists_each_candidates_interval_and_says_when_too_close(halves):
    plans = [_plan(2.0, layout="tp=8,dp=8"), _plan(3.0, layout="tp=4,dp=16")]
    assert intervals.search_lines(plans) == [
        "",
        "Step-time intervals of the candidates (50 %), in the order above",
        "    1. tp=8,cp=1,pp=1,dp=8                2 s  1 s .. 4 s",
        "    2. tp=4,cp=1,pp=1,dp=16               3 s  1.5 s .. 6 s",
        "  the two best overlap: too close to call (measure both, or anchor on a run)",
    ]
    assert len(intervals.search_lines([plans[0], _plan(9.0)])) == 4


def test_megatrons_three_stacks_share_one_group_and_the_others_keep_their_own(monkeypatch):
    """NeMo runs Megatron-Core, which grew out of Megatron-LM: a plan on any of the three takes the
    "megatron" group; other stacks are their own."""
    assert [intervals.stack_family(name) for name in ("nemo", "megatron-core", "megatron-lm")] == [
        "megatron"
    ] * 3
    assert [intervals.stack_family(name) for name in ("fsdp", "deepspeed", "meta-llama3")] == [
        "fsdp",
        "deepspeed",
        "meta-llama3",
    ]
    groups = (_group(key=("A100", "megatron", "cluster"), width=LN2),)
    monkeypatch.setattr(intervals, "table", lambda: (0.5, groups))
    for stack in ("nemo", "megatron-core", "megatron-lm"):
        got = intervals.plan_intervals(_plan(stack=stack))
        assert got["step_time_s_interval"] == [1.0, 4.0], stack
    assert intervals.plan_intervals(_plan(stack="fsdp"))["step_time_s_interval"] is None


def test_a_plan_is_unanchored_unless_told(monkeypatch):
    """An anchored group of the same key, half as wide at the anchor's own spread: only a caller that
    names an anchor gets it."""
    unanchored = _group(key=("A100", "fsdp", "cluster"), width=LN2)
    anchored = _group(
        anchored=True, key=("A100", "fsdp", "cluster"), width=LN2 / 2 / SPREAD_FLOOR, shape=SAME
    )
    monkeypatch.setattr(intervals, "table", lambda: (0.5, (unanchored, anchored)))
    anchor = _plan()
    assert intervals.plan_intervals(_plan())["step_time_s_interval"] == [1.0, 4.0]
    assert intervals.plan_intervals(_plan(), anchor)["step_time_s_interval"] == pytest.approx(
        [2 / math.sqrt(2), 2 * math.sqrt(2)], rel=1e-12
    )
    # 2 s and 5 s: [1, 4] and [2.5, 10] overlap; anchored [1.41, 2.83] and [3.54, 7.07] do not
    plans = [_plan(2.0), _plan(5.0)]
    assert intervals.too_close(plans) and not intervals.too_close(plans, anchor)
    assert intervals.search_lines(plans)[2].endswith("1 s .. 4 s")
    assert intervals.search_lines(plans, anchor)[2].endswith("1.414 s .. 2.828 s")


def test_the_spread_is_the_floor_plus_how_far_the_gpu_time_per_token_moves():
    """1 ms per token at the anchor; 2 ms (more GPUs, or fewer tokens/s) or 0.5 ms move it by ln 2
    either way; the same per-GPU microbatch work is SAME, another TP, PP, CP degree, microbatch size
    or virtual-stage count RESHAPED."""
    anchor = _plan(gpus=64, tokens_per_s=64_000.0, layout="tp=8,pp=2,dp=4")
    assert anchored_spread(anchor, anchor) == (SAME, SPREAD_FLOOR)
    more_gpus = _plan(gpus=256, tokens_per_s=128_000.0, layout="tp=8,pp=2,dp=16")
    assert anchored_spread(more_gpus, anchor) == (SAME, pytest.approx(SPREAD_FLOOR + LN2))
    faster = _plan(gpus=64, tokens_per_s=128_000.0, layout="tp=8,pp=2,dp=4")
    assert anchored_spread(faster, anchor) == (SAME, pytest.approx(SPREAD_FLOOR + LN2))
    for layout in ("tp=4,pp=2,dp=8", "tp=8,pp=4,dp=2", "tp=8,cp=2,pp=2,dp=2"):
        assert anchored_spread(_plan(layout=layout), anchor)[0] == RESHAPED, layout
    assert anchored_spread(_plan(layout="tp=8,pp=2,dp=4", micro_seqs=2), anchor)[0] == RESHAPED
    deeper = _plan(layout="tp=8,pp=2,dp=4")
    deeper.config.virtual_stages = 2
    assert anchored_spread(deeper, anchor)[0] == RESHAPED


def test_an_anchored_interval_is_its_groups_half_width_times_its_spread(monkeypatch):
    """Rank 1 in spreads: e^±(0.02 + ln 2) two GPU-time doublings away, e^±0.02 at the anchor; a
    reshaped prediction with no reshaped group takes the unanchored one, unscaled; memory is never
    scaled."""
    same = _group(anchored=True, key=("A100", "fsdp", "cluster"), width=1.0, shape=SAME)
    unanchored = _group(key=("A100", "fsdp", "cluster"), width=LN2)
    memory = _group(quantity="memory", anchored=True, width=0.25, rows=3, shape=SAME)
    monkeypatch.setattr(intervals, "table", lambda: (0.8, (same, unanchored, memory)))
    anchor = _plan(gpus=64, tokens_per_s=64_000.0)
    far = _plan(gpus=128, tokens_per_s=64_000.0, layout="tp=8,dp=16")
    got = intervals.plan_intervals(far, anchor)
    width = SPREAD_FLOOR + LN2
    assert got["step_time_s_interval"] == pytest.approx([2 * math.exp(-width), 2 * math.exp(width)])
    assert got["memory_gb_interval"] == pytest.approx([40 * math.exp(-0.25), 40 * math.exp(0.25)])
    assert intervals.json_keys(far, anchor)["interval_spread"] == pytest.approx(width)
    assert intervals.json_keys(far, anchor)["interval_shape"] == SAME
    assert "interval_spread" not in intervals.json_keys(far)
    own = intervals.plan_intervals(anchor, anchor)["step_time_s_interval"]
    assert own == pytest.approx([2 * math.exp(-SPREAD_FLOOR), 2 * math.exp(SPREAD_FLOOR)])
    reshaped = intervals.plan_intervals(_plan(layout="tp=4,dp=16"), anchor)
    assert reshaped["step_time_s_interval"] == [1.0, 4.0]
    assert intervals.report_lines(_plan(layout="tp=4,dp=16"), anchor)[-1] == (
        "  the step time's spread 0.02: 0.02 + how far the GPU-seconds per token move from the "
        "anchor's, other per-GPU microbatch work (reshaped)"
    )


def test_groups_rank_anchored_residuals_over_their_spreads_and_keep_the_shape():
    rows = [
        _row("time", True, "H100", "fsdp", "node", 0.2) | {"shape": SAME, "spread": 0.4},
        _row("time", True, "H100", "fsdp", "node", -0.9) | {"shape": RESHAPED, "spread": 0.3},
        _row("time", False, "H100", "fsdp", "node", 0.3),
    ]
    got = {
        (g.anchored, g.generation, g.stack, g.scale, g.shape): g.half_width
        for g in groups_of(rows, level=0.5)
    }
    assert got[(True, "H100", "fsdp", "node", SAME)] == pytest.approx(0.5)  # 0.2 / 0.4
    assert got[(True, ANY, ANY, ANY, RESHAPED)] == pytest.approx(3.0)  # 0.9 / 0.3
    assert got[(False, "H100", "fsdp", "node", ANY)] == 0.3  # unanchored: spread 1, no shape
    assert (True, ANY, ANY, ANY, ANY) not in got  # the shapes never pool
