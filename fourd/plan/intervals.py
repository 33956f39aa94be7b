"""Prediction intervals: how far the planner's step time, MFU and memory may be off, from how far it
was off on comparable rows of the validation suite it never fitted
(benchmarks/validation/runs.toml). An anchored step time's interval also grows with how far the
prediction moves from what the anchor measured (its spread).

The table beside this file (intervals.toml) is generated, never edited: `python
benchmarks/validation/anchored.py --write-intervals` writes it from the out-of-sample residuals
(regenerate it after the model changes). docs/planner.md, "Anchored predictions and intervals", says
how it is computed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import tomllib

TABLE = Path(__file__).with_name("intervals.toml")
LEVEL = 0.8  # the intervals' coverage
# A group smaller than this falls back to a wider one: below 8 rows the conformal rank at 80 % is
# the group's largest residual, which one odd row sets (chosen on the suite: docs/planner.md,
# Intervals).
MIN_ROWS = 8
FEWEST = (
    3  # the widest group (all rows of a quantity) serves down to this many rows: memory has few
)
ANY = "*"
# A row's scale: one server, up to a large cluster, beyond (where cross-rack and pod traffic
# dominate).
SCALES = ((8, "node"), (1024, "cluster"))
WIDEST = "large"
# The GPU generations of the suite's rows: an H200 is an H100 die with more memory, the export parts
# A800 and H800 the A100's and H100's dies with slower NVLink.
GENERATIONS = {"A100": "A100", "A800": "A100", "H100": "H100", "H200": "H100", "H800": "H100"}
# Stacks of one code base share their groups: NeMo runs Megatron-Core, which grew out of Megatron-LM,
# so a row of one is judged by the others' rows before by every row of its GPU (docs/planner.md,
# Intervals: chosen on the suite); FSDP2 is PyTorch's FSDP rewritten, one family with FSDP1.
STACK_FAMILIES = {
    "nemo": "megatron",
    "megatron-core": "megatron",
    "megatron-lm": "megatron",
    "fsdp2": "fsdp",
}
# An anchored prediction of the anchor's own shape (TP, CP and PP degrees, microbatch size, virtual
# stages: the per-GPU work of a microbatch) carries the measured rate to the same kernels; a reshaped
# one carries it to other GEMM shapes and stage sizes, which the model alone relates.
SAME, RESHAPED = "same", "reshaped"
# The spread of an anchored step time at the anchor's own GPU-time per token: published step times
# are rounded to 2-3 digits and repeated runs differ by a percent or two (docs/planner.md, Intervals:
# chosen on the suite, where 0.5 to 5 % give a median anchored half-width of 4.0 to 6.1 %).
SPREAD_FLOOR = 0.02


def scale(gpus: int) -> str:
    return next((name for top, name in SCALES if gpus <= top), WIDEST)


def stack_family(stack: str) -> str:
    """The group key of a stack: its family (STACK_FAMILIES), else itself."""
    return STACK_FAMILIES.get(stack, stack)


def generation(gpu_name: str) -> str:
    """The GPU generation of a GPU name (`H100 SXM 80GB` -> H100); others are their own (CPU
    ...)."""
    word = gpu_name.split()[0].upper() if gpu_name else ANY
    return GENERATIONS.get(word, word)


def half_width(residuals: list[float], level: float = LEVEL) -> float:
    """The split-conformal half-width of `residuals` (|log(published / predicted)| of held-out
    rows): the ⌈(n+1)·level⌉-th smallest, so that a new row exchangeable with these falls inside
    predicted·exp(±h) with probability at least `level` (Vovk et al. 2005; Lei et al. 2018, §2.2);
    the largest when n is too small for that rank."""
    ordered = sorted(abs(residual) for residual in residuals)
    if not ordered:
        return math.inf
    rank = math.ceil((len(ordered) + 1) * level)
    return ordered[min(rank, len(ordered)) - 1]


def _per_gpu_work(plan) -> tuple[int, int, int, int, int]:
    """What one GPU runs of a microbatch: TP, CP and PP degrees, sequences per microbatch, virtual
    stages."""
    layout = plan.config.layout
    return (layout.tp, layout.cp, layout.pp, plan.micro_seqs, plan.config.virtual_stages)


def anchored_spread(plan, anchor) -> tuple[str, float]:
    """(shape, spread) of the anchored prediction `plan` from `anchor` (the anchored plan of the
    anchor's own configuration, whose step is the measured one): SAME when one GPU runs the same
    microbatch work, else RESHAPED; and

        spread = SPREAD_FLOOR + |log(g_plan / g_anchor)|,   g = GPUs / tokens per second

    how far the prediction moves the GPU-seconds per token from the measured ones. The residuals of
    anchored rows are divided by it before their conformal rank is taken, and a plan's half-width is
    that rank times its own spread (normalized conformal prediction: Papadopoulos et al. 2008; Lei et
    al. 2018 §5.2): predicting the anchor's own configuration back is as sure as a measurement, a
    prediction the model moves far from it as unsure as the move."""
    moved = math.log((plan.gpus / plan.tokens_per_s) / (anchor.gpus / anchor.tokens_per_s))
    same = _per_gpu_work(plan) == _per_gpu_work(anchor)
    return (SAME if same else RESHAPED), SPREAD_FLOOR + abs(moved)


@dataclass(frozen=True)
class Group:
    """Rows sharing what an interval is looked up by (ANY: all of that key)."""

    quantity: str  # "time" or "memory"
    anchored: bool
    generation: str
    stack: str
    scale: str
    rows: int
    # natural log, in units of the rows' spread (1 but for anchored step times): the interval is
    # point·exp(±half_width·spread)
    half_width: float
    shape: str = ANY  # anchored rows: SAME or RESHAPED

    def width(self, spread: float) -> float:
        """The half-width, natural log, of a prediction with this spread: half_width·spread in an
        anchored group, half_width in an unanchored one (its rows' spread is 1)."""
        return self.half_width * (spread if self.anchored else 1.0)


# A row's keys, and the groups an interval is looked up in, narrowest first: the keys each group keeps
# (the others match any value). Unanchored, the generation is kept longest (the planner's GEMM
# efficiency is fitted per generation, and its errors follow it); anchored, it is dropped first: the
# anchor measured this GPU running this stack, so the error left is the scale-out the model adds, and
# the stack's rows on other GPUs judge that before other stacks' rows on this one; the shape is kept
# throughout: a reshaped prediction is judged by reshaped ones, and without enough of them by the
# unanchored rows (docs/planner.md, Intervals).
KEYS = ("generation", "stack", "scale", "shape")
KEPT: dict[bool, tuple[tuple[str, ...], ...]] = {
    False: (("generation", "stack", "scale"), ("generation", "stack"), ("generation",), ()),
    True: (KEYS, ("stack", "scale", "shape"), ("stack", "shape"), ("shape",)),
}


def _key(values: dict, kept: tuple[str, ...]) -> tuple[str, ...]:
    """`values`' (generation, stack, scale, shape), those `kept` leaves out as ANY."""
    return tuple(values.get(name, ANY) if name in kept else ANY for name in KEYS)


def groups_of(rows: list[dict], level: float = LEVEL) -> list[Group]:
    """Every group of `rows` (dicts with quantity, anchored, generation, stack, scale, residual, and
    for anchored rows shape and spread), for each quantity and anchoring at each of its KEPT widths,
    narrowest first; a group's half-width is the conformal rank of its residuals over their
    spreads."""
    out = []
    for quantity in sorted({row["quantity"] for row in rows}):
        for anchored in sorted({row["anchored"] for row in rows if row["quantity"] == quantity}):
            mine = [
                row for row in rows if row["quantity"] == quantity and row["anchored"] == anchored
            ]
            for kept in KEPT[anchored]:
                for key in sorted({_key(row, kept) for row in mine}):
                    scores = [
                        row["residual"] / row.get("spread", 1.0)
                        for row in mine
                        if _key(row, kept) == key
                    ]
                    out.append(
                        Group(
                            quantity=quantity,
                            anchored=anchored,
                            rows=len(scores),
                            half_width=half_width(scores, level),
                            **dict(zip(KEYS, key)),
                        )
                    )
    return out


def lookup(
    groups: list[Group],
    quantity: str,
    anchored: bool,
    gen: str,
    stack: str,
    scale_name: str,
    shape: str = ANY,
) -> Group | None:
    """The narrowest group of at least MIN_ROWS rows that matches, in KEPT's order (the widest, all
    rows, down to FEWEST); anchored predictions without enough anchored rows of their shape fall
    back to the unanchored groups."""
    want = dict(zip(KEYS, (gen, stack, scale_name, shape)))
    for flag in (anchored, False) if anchored else (False,):
        widths = KEPT[flag]
        for width, kept in enumerate(widths):
            key = _key(want, kept)
            fewest = FEWEST if width == len(widths) - 1 else MIN_ROWS
            for group in groups:
                group_key = tuple(getattr(group, name) for name in KEYS)
                same = (group.quantity, group.anchored, group_key) == (quantity, flag, key)
                if same and group.rows >= fewest:
                    return group
    return None


@cache
def table() -> tuple[float, tuple[Group, ...]]:
    """(level, groups) of intervals.toml; (LEVEL, ()) when it has not been written yet."""
    if not TABLE.exists():
        return LEVEL, ()
    data = tomllib.loads(TABLE.read_text())
    return data.get("level", LEVEL), tuple(Group(**group) for group in data.get("group", []))


def interval(
    point: float, quantity: str, anchored: bool, keys: tuple[str, ...], spread: float = 1.0
) -> tuple[float, float] | None:
    """[low, high] around `point` from the table's group matching `keys` (generation, stack, scale,
    shape), its half-width times the prediction's spread where the group is anchored; None when the
    table has none."""
    group = lookup(list(table()[1]), quantity, anchored, *keys)
    if group is None:
        return None
    width = group.width(spread)
    return point * math.exp(-width), point * math.exp(width)


def _plan_keys(plan, stack: str | None) -> tuple[str, str, str]:
    """A plan's (generation, stack family, scale); the stack the planner names (the anchor's, or the
    plan's own where the planner knows stacks), else ANY."""
    name = stack or getattr(plan.job, "stack", None) or ANY
    family = stack_family(str(getattr(name, "name", name)))
    return generation(plan.cluster.gpu.name), family, scale(plan.gpus)


def plan_intervals(plan, anchor=None, stack: str | None = None) -> dict:
    """The plan's step time, MFU and memory intervals: {key: [low, high] or None}. `anchor`: for an
    anchored plan, the anchored plan of the anchor's own configuration (`anchored_spread`)."""
    gen, stack_name, size = _plan_keys(plan, stack)
    anchored = anchor is not None
    shape, time_spread = anchored_spread(plan, anchor) if anchored else (ANY, 1.0)
    keys = (gen, stack_name, size, shape)
    time = interval(plan.step.step_s, "time", anchored, keys, time_spread)
    memory = interval(plan.peak_gb, "memory", anchored, keys)
    # MFU is the inverse of the step time: a slower step, a lower MFU
    mfu = (
        None
        if time is None
        else (plan.mfu * plan.step.step_s / time[1], plan.mfu * plan.step.step_s / time[0])
    )
    return {
        "step_time_s_interval": time and list(time),
        "mfu_interval": mfu and list(mfu),
        "memory_gb_interval": memory and list(memory),
    }


def json_keys(plan, anchor=None, stack: str | None = None) -> dict:
    """`--json`'s interval keys, the level and the peak memory they bracket; anchored, the shape
    and spread the step time's interval was taken at (`anchored_spread`)."""
    out = plan_intervals(plan, anchor, stack)
    out |= {"interval_level": table()[0], "peak_memory_gb": plan.peak_gb}
    if anchor is not None:
        shape, spread = anchored_spread(plan, anchor)
        out |= {"interval_shape": shape, "interval_spread": spread}
    return out


def _span(pair, form: str) -> str:
    return (
        "no interval (intervals.toml not written)"
        if pair is None
        else f"{form.format(pair[0])} .. {form.format(pair[1])}"
    )


def report_lines(plan, anchor=None, stack: str | None = None) -> list[str]:
    """The text report's interval section."""
    got, level = plan_intervals(plan, anchor, stack), table()[0]
    kind = "unanchored" if anchor is None else "anchored"
    lines = [
        "",
        f"Intervals ({100 * level:.0f} %, from the validation suite's {kind} out-of-sample rows)",
        f"  step time      {plan.step.step_s:>10.4g} s     "
        f"{_span(got['step_time_s_interval'], '{:.4g} s')}",
        f"  MFU            {100 * plan.mfu:>10.1f} %     "
        f"{_span(got['mfu_interval'] and [100 * x for x in got['mfu_interval']], '{:.1f} %')}",
        f"  peak memory    {plan.peak_gb:>10.1f} GB    "
        f"{_span(got['memory_gb_interval'], '{:.1f} GB')}",
    ]
    if anchor is not None:
        shape, spread = anchored_spread(plan, anchor)
        work = "the anchor's" if shape == SAME else "other"
        lines.append(
            f"  the step time's spread {spread:.3g}: {SPREAD_FLOOR:g} + how far the GPU-seconds per "
            f"token move from the anchor's, {work} per-GPU microbatch work ({shape})"
        )
    return lines


def too_close(plans: list, anchor=None, stack: str | None = None) -> bool:
    """Whether the two best fitting plans' step-time intervals overlap."""
    best = [plan for plan in plans if plan.fits][:2]
    if len(best) < 2:
        return False
    first, second = (plan_intervals(plan, anchor, stack)["step_time_s_interval"] for plan in best)
    return bool(first and second and first[0] <= second[1] and second[0] <= first[1])


def search_lines(plans: list, anchor=None, stack: str | None = None) -> list[str]:
    """`--search`'s interval of each listed candidate, and whether the two best can be told
    apart."""
    level = table()[0]
    out = ["", f"Step-time intervals of the candidates ({100 * level:.0f} %), in the order above"]
    for i, plan in enumerate(plans):
        pair = plan_intervals(plan, anchor, stack)["step_time_s_interval"]
        out.append(
            f"  {i + 1:>3}. {str(plan.config.layout):<26} {plan.step.step_s:>9.4g} s  "
            f"{_span(pair, '{:.4g} s')}"
        )
    if too_close(plans, anchor, stack):
        out.append("  the two best overlap: too close to call (measure both, or anchor on a run)")
    return out
