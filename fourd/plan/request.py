"""The one resolver of planner requests: `fourd plan`, `fourd sim step`, the lab's planner panel and the
trainer's `--layout auto` all turn their settings into a Request here, defaults filled in one way, the
user's own settings checked before the search, and the settings left open named.

Stable entry points for other parts of fourd (no torch):
  best_plan(model, cluster, gpus, seq, global_seqs, fixed=None) -> Plan   (.config is a Parallelism)
  rank_peak_memory_gb(model, cluster, par, seq, global_seqs) -> float     (the fullest GPU, runtime included)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from fourd.errors import FourdError
from fourd.layout import PRECISIONS, RECOMPUTE, ZERO_STAGES, Layout, Parallelism, parse_layout
from fourd.layout import check as layout_check
from fourd.model.config import ModelConfig, get_preset, parse_model_spec
from fourd.plan.cluster import Cluster, load_cluster
from fourd.plan.job import Job
from fourd.plan.search import Fixed, Plan, search
from fourd.schedules import SCHEDULES

DEFAULT_MODEL = "llama3-405b"
DEFAULT_CLUSTER = "llama3-h100"
DEFAULT_BATCH_TOKENS = 2**24  # 16M tokens per step, Llama 3's
MAX_GPUS = 1 << 20  # the search enumerates divisors: a million GPUs answers in a second
MAX_SEQ = 1 << 24
_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "B": 1e9, "T": 1e12}


class BadValue(FourdError, argparse.ArgumentTypeError):
    """A flag's value out of range: argparse names the flag, other callers see a FourdError."""


def bounded(kind: type, lo: float, hi: float = math.inf, what: str = ""):
    """A parser (an argparse `type`) of a finite `kind` (int or float) from lo to hi."""

    def parse(text) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise BadValue(f"{str(text)[:40]!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            top = "" if hi == math.inf else f" to {hi:.10g}"
            raise BadValue(
                f"{value} is out of range: give {what or ('a number' if kind is float else 'a whole number')} from {lo:g}{top}"
            )
        return value

    parse.__name__ = kind.__name__
    return parse


def count(text) -> float:
    """A positive amount: `16777216`, `16M` (K, M, G binary, for batch sizes: 16M = 2^24), `15.6T` (B, T
    decimal, for budgets), `4e6`."""
    t = str(text).strip()
    try:
        value = float(t[:-1]) * _SUFFIX[t[-1].upper()] if t and t[-1].upper() in _SUFFIX else float(t)
    except ValueError:
        raise BadValue(f"{t[:40]!r} is not a count: write e.g. 16777216, 16M or 15.6T") from None
    if not (math.isfinite(value) and value > 0):
        raise BadValue(f"{t[:40]!r} must be a positive finite count, e.g. 16M or 15.6T")
    return value


def on_off(text) -> bool:
    if isinstance(text, bool):
        return text
    if text not in ("on", "off"):
        raise BadValue(f"{str(text)[:40]!r}: choose on or off")
    return text == "on"


# The planner's flags, each parsed in one place (the lab's panel reuses the parsers by name).
PARSERS: dict[str, Any] = {
    "gpus": bounded(int, 1, MAX_GPUS),
    "layout": parse_layout,
    "schedule": str,
    "microbatches": bounded(int, 1, 1 << 30),
    "virtual_stages": bounded(int, 1, 1 << 16),
    "seq": bounded(int, 2, MAX_SEQ, "a sequence length"),
    "global_batch_tokens": count,
    "recompute": str,
    "zero": bounded(int, 0, 3, "a ZeRO stage"),
    "sequence_parallel": on_off,
    "precision": str,
    "compiled": on_off,
    "train_tokens": count,
}


def add_arguments(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--model", help=f"model preset: debug, small, llama3-8b, llama3-70b, llama3-405b (default {DEFAULT_MODEL})"
    )
    g.add_argument(
        "--model-spec",
        type=parse_model_spec,
        help="a model by its dimensions: layers=,dim=,ffn=,heads=,kv_heads=,vocab=[,head_dim=][,mlp=gelu]",
    )
    p.add_argument("--cluster", help=f"cluster profile name or .toml path (default {DEFAULT_CLUSTER})")
    p.add_argument("--gpus", type=PARSERS["gpus"], help="number of GPUs, any count (default: the layout's product)")
    p.add_argument(
        "--layout", type=parse_layout, help="tp=8,cp=1,pp=16,dp=64 (omitted dimensions are 1; default: searched)"
    )
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule")
    p.add_argument("--microbatches", type=PARSERS["microbatches"], help="microbatches per DP replica per step")
    p.add_argument(
        "--virtual-stages", type=PARSERS["virtual_stages"], help="pipeline stages per rank (interleaved schedule)"
    )
    p.add_argument(
        "--seq",
        type=PARSERS["seq"],
        help="sequence length in tokens (default: the model's max_seq; on a CPU profile `fourd train`'s)",
    )
    p.add_argument(
        "--global-batch-tokens",
        type=count,
        help="tokens per optimizer step (default 16M = 16,777,216, Llama 3's; on a CPU profile `fourd train`'s)",
    )
    p.add_argument("--recompute", choices=RECOMPUTE, help="activation recomputation")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, help="ZeRO stage of the data-parallel sharding")
    p.add_argument(
        "--sequence-parallel",
        type=on_off,
        metavar="{on,off}",
        help="sequence parallelism with TP (default on; on a CPU profile `fourd train`'s, off)",
    )
    p.add_argument(
        "--dtype", dest="precision", choices=PRECISIONS, help="training precision (default: the cluster profile's)"
    )
    p.add_argument(
        "--compile",
        dest="compiled",
        type=on_off,
        metavar="{on,off}",
        help="torch.compile'd kernels (default off: eager, as `fourd train` runs)",
    )
    p.add_argument("--train-tokens", type=count, help="token budget of the whole run, e.g. 15.6T, for training_days")
    p.add_argument("--search", action="store_true", help="rank every valid configuration; report the best and the top")
    p.add_argument("--top", type=bounded(int, 1, 10_000), default=10, help="candidates listed by --search (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Request:
    """A planner request, resolved: what runs (`base`: its Parallelism is a placeholder the search
    replaces), on how many GPUs, the settings the user pinned and the ones left to the planner."""

    base: Job
    gpus: int
    fixed: Fixed
    open: tuple[str, ...]
    train_tokens: float | None = None


def resolve_inputs(args) -> Request:
    """The request `fourd plan`'s flags (`add_arguments`) describe, as every command that takes them reads it."""
    model = args.model_spec or get_preset(args.model or DEFAULT_MODEL)
    names = [f.name for f in fields(Fixed)] + [
        "gpus",
        "seq",
        "global_batch_tokens",
        "precision",
        "compiled",
        "train_tokens",
    ]
    return resolve(model, load_cluster(args.cluster or DEFAULT_CLUSTER), {k: getattr(args, k) for k in names})


SETTINGS = ("layout", "schedule", "microbatches", "virtual_stages", "zero", "recompute", "sequence_parallel")
KEYS = (*SETTINGS, "gpus", "seq", "global_batch_tokens", "global_seqs", "precision", "compiled", "train_tokens")
_CHOICES = {"schedule": SCHEDULES, "recompute": RECOMPUTE, "zero": ZERO_STAGES, "precision": PRECISIONS}


def _values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every known setting, parsed and range-checked (None: not given), whether it came as text or typed."""
    bad = sorted(set(values) - set(KEYS))
    if bad:
        raise FourdError(f"unknown planner setting(s) {', '.join(bad)}; known: {', '.join(KEYS)}")
    out: dict[str, Any] = dict.fromkeys(KEYS)
    for key, value in values.items():
        if value is None or value == "":
            continue
        try:
            out[key] = PARSERS.get(key, bounded(int, 1, 1 << 40))(value)
            if key in _CHOICES and out[key] not in _CHOICES[key]:
                raise FourdError(f"{str(value)[:40]!r}: choose one of {', '.join(map(str, _CHOICES[key]))}")
        except FourdError as e:
            raise FourdError(f"{key.replace('_', ' ')} {e}") from None
    return out


def resolve(model: ModelConfig, cluster: Cluster, values: Mapping[str, Any]) -> Request:
    """The one resolver: `values` names any of KEYS (text or typed; None or absent: left open or defaulted).

    On a CPU profile (what `fourd calibrate` writes) the sequence length, global batch and sequence
    parallelism default to what `fourd train` runs; elsewhere to the model's max_seq, 16M tokens and SP on.
    Settings the user pinned are checked (fourd.layout.check) before any search.
    """
    v = _values(values)
    if cluster.cpu:
        from fourd.config import DataSection, ParallelSection, TrainSection
    seq = v["seq"] or (DataSection().seq_len if cluster.cpu else model.max_seq)
    global_seqs = v["global_seqs"]
    if global_seqs is None:
        tokens = v["global_batch_tokens"] or (
            TrainSection().global_batch * seq if cluster.cpu else DEFAULT_BATCH_TOKENS
        )
        if tokens % seq or tokens < seq:
            raise FourdError(
                f"a global batch of {tokens:g} tokens is not a whole number of {seq}-token sequences: use a multiple of {seq}"
            )
        global_seqs = int(tokens // seq)
    sp = v["sequence_parallel"]
    if sp is None:
        sp = ParallelSection().sequence_parallel if cluster.cpu else True
    layout, gpus = v["layout"], v["gpus"]
    if layout is None and gpus is None:
        raise FourdError("give the number of GPUs or a layout (its product is the number of GPUs)")
    gpus = gpus or layout.world
    if layout is not None and layout.world != gpus:
        raise FourdError(
            f"layout {layout} uses {layout.world} GPUs but {gpus} are asked: make the product of the degrees equal {gpus}"
        )
    schedule = v["schedule"] or ("interleaved" if (v["virtual_stages"] or 1) > 1 else None)
    fixed = Fixed(layout, schedule, v["microbatches"], v["virtual_stages"], v["zero"], v["recompute"], sp)
    interleaving = schedule in (None, "interleaved")
    open_ = tuple(
        name.replace("_", " ")
        for name in ("layout", "schedule", "virtual_stages", "microbatches", "zero", "recompute")
        if getattr(fixed, name) is None and (interleaving or name != "virtual_stages")
    )
    share = layout.dp * (fixed.microbatches or 1) if layout else 1
    if v["global_seqs"] is None and global_seqs % share:
        # a batch given in tokens is a target: the nearest batch that the pinned replicas share equally
        global_seqs = max(1, round(global_seqs / share)) * share
        open_ += (
            f"global batch (rounded to {global_seqs:,} sequences, {global_seqs // share * (fixed.microbatches or 1)} per replica)",
        )
    base = Job(model, cluster, Parallelism(Layout()), seq, global_seqs, v["precision"], bool(v["compiled"]))
    if layout is not None:
        # name what is wrong with the user's own settings before searching the rest
        mine = Parallelism(layout, schedule or "1f1b", fixed.microbatches or 1, fixed.virtual_stages or 1,
                           fixed.zero or 0, fixed.recompute or "none", sp)  # fmt: skip
        layout_check(model, mine, seq, global_seqs)
    return Request(base, gpus, fixed, open_, v["train_tokens"])


def plans(req: Request) -> list[Plan]:
    """Every configuration the request allows, fitting first, fastest first; FourdError when there is none."""
    found = search(req.base, req.gpus, req.fixed, req.open)
    if not found:
        b, m = req.base, req.fixed.microbatches
        raise FourdError(
            f"no configuration of {req.gpus} GPUs runs this model with {b.seq}-token sequences and "
            f"{b.global_seqs} sequences per step{f' in {m} microbatches per replica' if m else ''}: change the "
            f"number of GPUs, the sequence length{', the microbatches' if m else ''} or the global batch"
        )
    return found


def best_plan(model: ModelConfig, cluster: Cluster | str, gpus: int, seq: int, global_seqs: int, fixed=None) -> Plan:
    """The fastest plan that fits (the smallest if none fits) for `gpus` GPUs; `fixed` pins settings by name
    (any of SETTINGS, `precision`, `compiled`; a layout as a Layout or its text), the rest are searched."""
    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    return plans(resolve(model, cluster, {**(fixed or {}), "gpus": gpus, "seq": seq, "global_seqs": global_seqs}))[0]


def rank_peak_memory_gb(
    model: ModelConfig, cluster: Cluster | str, par: Parallelism, seq: int, global_seqs: int
) -> float:
    """GB (10^9 bytes) the fullest GPU holds at its peak for this configuration, the runtime's reserve
    included; FourdError if the configuration cannot run."""
    from fourd.plan.memory import GB, peak_memory

    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    layout_check(model, par, seq, global_seqs)
    memory = peak_memory(Job(model, cluster, par, seq, global_seqs))[1]
    return (memory.total + memory.reserve) / GB
