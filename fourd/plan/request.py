"""The one resolver of planner requests (`fourd plan`, `fourd sim step`, the lab, the trainer):
settings parsed and checked in one place, defaults filled one way, those left open named. Entry
points: docs/planner.md."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fourd.errors import FourdError
from fourd.layout import RECOMPUTE, ZERO_STAGES, Layout, Parallelism, parse_layout
from fourd.layout import check as layout_check
from fourd.model.config import ModelConfig, get_preset, parse_model_spec
from fourd.plan.cluster import FP8, PLAN_PRECISIONS, Cluster, load_cluster
from fourd.plan.cluster import preset_names as cluster_presets
from fourd.plan.job import ATTENTION, Job
from fourd.plan.search import OPEN, Plan, Ranking, rank
from fourd.plan.stack import (
    DEFAULT_STACK,
    FUSED_ATTENTION,
    PIPELINE_COMM,
    Stack,
    load_stack,
    parse_stack,
    preset_names,
    switch,
)
from fourd.schedules import SCHEDULES, check_stages

DEFAULT_MODEL = "llama3-405b"
DEFAULT_CLUSTER = "llama3-h100"
DEFAULT_BATCH_TOKENS = 2**24  # 16M tokens per step, Llama 3's
MAX_GPUS = 1 << 20  # a million GPUs: the search still answers in about a second
_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "B": 1e9, "T": 1e12}
ALLOWED: dict[Any, tuple] = {}  # parser -> the values it takes


class BadValue(FourdError, argparse.ArgumentTypeError):
    """A value out of range: argparse names the flag it came with, other callers see a
    FourdError."""


def bounded(kind: type, lo: float, hi: float = math.inf, what: str = ""):
    """A parser (an argparse `type`) of a finite `kind` (int or float) from lo to hi."""
    what = what or ("a number" if kind is float else "a whole number")

    def parse(text) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise BadValue(
                f"{str(text)[:40]!r} is not {'a number' if kind is float else 'a whole number'}"
            ) from None
        if not (math.isfinite(value) and lo <= value <= hi):
            if hi == math.inf:
                top = ""
            elif kind is int:
                top = f" to {hi:,}"
            else:
                top = f" to {hi:.10g}"
            raise BadValue(f"{value} is out of range: give {what} from {lo:.10g}{top}")
        return value

    return parse


def choice(allowed, kind: type = str):
    """A parser of one of `allowed` (ALLOWED[parser] names them in --help)."""

    def parse(text) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            value = None
        if value not in allowed or isinstance(text, bool):
            raise BadValue(f"{str(text)[:40]!r}: choose one of {', '.join(map(str, allowed))}")
        return value

    ALLOWED[parse] = allowed
    return parse


def count(text) -> float:
    """A positive amount: `16777216`, `16M` (K, M, G binary: 16M = 2^24), `15.6T` (B, T decimal),
    `4e6`."""
    token = str(text).strip()
    try:
        value = (
            float(token[:-1]) * _SUFFIX[token[-1].upper()]
            if token and token[-1].upper() in _SUFFIX
            else float(token)
        )
    except ValueError:
        raise BadValue(
            f"{token[:40]!r} is not a count: write e.g. 16777216, 16M or 15.6T"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise BadValue(f"{token[:40]!r} must be a positive finite count, e.g. 16M or 15.6T")
    return value


def on_off(text) -> bool:
    if isinstance(text, bool) or text in ("on", "off"):
        return text in (True, "on")
    raise BadValue(f"{str(text)[:40]!r}: choose on or off")


ALLOWED[on_off] = ("on", "off")
# Every setting a request takes: its parser (for text and typed values alike) and its --help; None
# pins nothing.
SETTINGS: dict[str, tuple[Any, str]] = {
    "gpus": (
        bounded(int, 1, MAX_GPUS),
        "number of GPUs, any count (default: the layout's product)",
    ),
    "layout": (parse_layout, "tp=8,cp=1,pp=16,dp=64 (omitted dimensions are 1; default: searched)"),
    "schedule": (choice(SCHEDULES), "pipeline schedule"),
    "microbatches": (bounded(int, 1, 1 << 30), "microbatches per data-parallel replica per step"),
    "virtual_stages": (bounded(int, 1, 1 << 16), "pipeline stages per rank (interleaved schedule)"),
    "seq": (
        bounded(int, 2, 1 << 24, "a sequence length"),
        "tokens per sequence (default: the model's max_seq)",
    ),
    "global_batch_tokens": (count, "tokens per optimizer step (default 16M = 2^24, Llama 3's)"),
    "recompute": (choice(RECOMPUTE), "activation recomputation (docs/planner.md: what each keeps)"),
    "zero": (choice(ZERO_STAGES, int), "ZeRO stage of the data-parallel sharding"),
    "hsdp_replicas": (
        bounded(int, 1, MAX_GPUS),
        "HSDP: ZeRO (3 unless --zero says 1 or 2) inside each of this many replica groups",
    ),
    "sequence_parallel": (on_off, "sequence parallelism with TP (default on)"),
    "precision": (
        choice(PLAN_PRECISIONS),
        "training precision: bf16, fp32, or fp8 (Transformer Engine's: the layers' GEMMs in FP8, the "
        "rest BF16; GPUs whose profile gives fp8_peak_tflops); default: the cluster profile's",
    ),
    "compiled": (
        on_off,
        "the blocks torch.compile'd (default: the planner's choice, on; on a CPU profile off)",
    ),
    "attention": (
        choice(ATTENTION),
        "flash (fused, default), materialized (s x s scores, fused softmax: Megatron 2021-22) or "
        "eager (s x s scores, each op a kernel: Hugging Face's eager attention)",
    ),
    "pipeline_comm": (
        choice(PIPELINE_COMM),
        "overlapped, synchronous (Megatron's waited exchanges), interleaved-overlapped (Megatron-LM "
        "since 2023-10: synchronous under 1F1B, overlapped when interleaved) or blocking "
        "(DeepSpeed's pipeline engine); default: the stack's",
    ),
    "stack": (
        parse_stack,
        f"software stack: {', '.join(preset_names())}, or a .toml profile (default "
        f"{DEFAULT_STACK}; docs/planner.md: what each switches)",
    ),
    "tp_overlap": (
        on_off,
        "TP all-gathers and reduce-scatters overlapped with their GEMMs (needs sequence "
        "parallelism; default: the stack's)",
    ),
    "fused_kernels": (
        on_off,
        "the blocks' elementwise ops in fused kernels of the stack's own (Transformer Engine, Triton, "
        "XLA), as compiled (default: the stack's)",
    ),
    "shared_kv": (
        on_off,
        "with grouped-query attention, the attention kernel reads each K/V head for all its query "
        "heads, uncopied (SDPA's enable_gqa; off: copied first, as torchtitan's repeat_kv; default: "
        "the stack's)",
    ),
    "dp_overlap": (
        on_off,
        "data-parallel reductions and gathers overlapped with compute (default: the stack's)",
    ),
    "fused_attention": (
        choice(FUSED_ATTENTION),
        "the fused attention kernel: flash2 (FlashAttention-2), cudnn (cuDNN's, Transformer "
        "Engine's choice on Hopper), flash1 (the first FlashAttention) or triton (FlashAttention in "
        "Triton); default: the stack's",
    ),
    "train_tokens": (count, "token budget of the whole run, e.g. 15.6T, for training_days"),
    "global_seqs": (bounded(int, 1, 1 << 40), ""),  # the trainer's exact batch, in sequences
}
FLAGS = {"precision": "--dtype", "compiled": "--compile"}


def add_arguments(p) -> None:
    """`fourd plan`'s flags; `fourd sim step` takes them too. On a CPU profile (`fourd calibrate`
    writes one) --seq, --global-batch-tokens and --sequence-parallel default to what `fourd train`
    runs."""
    models = p.add_mutually_exclusive_group()
    models.add_argument(
        "--model",
        help=f"preset: debug, small, llama3-8b, llama3-70b, llama3-405b (default {DEFAULT_MODEL})",
    )
    models.add_argument(
        "--model-spec",
        type=parse_model_spec,
        help="layers=,dim=,ffn=,heads=,kv_heads=,vocab=[,head_dim=][,mlp=gelu|gelu_new][,tied=1]",
    )
    p.add_argument(
        "--cluster", help=f"cluster profile name or .toml path (default {DEFAULT_CLUSTER})"
    )
    for key, (parse, text) in ((k, setting) for k, setting in SETTINGS.items() if setting[1]):
        metavar = (
            "{" + ",".join(map(str, ALLOWED[parse])) + "}" if parse in ALLOWED else key.upper()
        )
        p.add_argument(
            FLAGS.get(key, "--" + key.replace("_", "-")),
            dest=key,
            type=parse,
            metavar=metavar,
            help=text,
        )
    p.add_argument(
        "--search",
        action="store_true",
        help="rank every valid configuration; report the best and the top",
    )
    p.add_argument(
        "--top",
        type=bounded(int, 1, 10_000),
        default=10,
        help="candidates listed by --search (default 10)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # anchored predictions (fourd.plan.anchor): a measured step pins the stack's rate
    p.add_argument("--anchor", metavar="FILE", help="a measured step (anchor.json) to predict from")


@dataclass(frozen=True)
class Request:
    """A resolved request: what runs (`base`, whose Parallelism the search replaces), on how many
    GPUs, the settings the user pinned and the ones left to the planner."""

    base: Job
    gpus: int
    fixed: (
        dict  # the settings pinned, by Parallelism's field names (fourd.plan.search.OPEN and more)
    )
    open: tuple[str, ...]
    train_tokens: float | None = None


def resolve_inputs(args) -> Request:
    """The request `fourd plan`'s flags (`add_arguments`) describe, as every command that takes them
    reads it."""
    model = args.model_spec or get_preset(args.model or DEFAULT_MODEL)
    cluster = load_cluster(args.cluster or DEFAULT_CLUSTER)
    return resolve(model, cluster, {k: getattr(args, k) for k in SETTINGS if k != "global_seqs"})


def _values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting, parsed and range-checked (None: not given), whether it came as text or
    typed."""
    if bad := ", ".join(sorted(set(values) - set(SETTINGS))):
        raise FourdError(f"unknown planner setting(s) {bad}; known: {', '.join(SETTINGS)}")
    out: dict[str, Any] = dict.fromkeys(SETTINGS)
    for key, value in values.items():
        try:
            out[key] = None if value is None or value == "" else SETTINGS[key][0](value)
        except FourdError as e:
            raise FourdError(f"{key.replace('_', ' ')} {e}") from None
    return out


def _batch(v: dict, seq: int, cluster: Cluster) -> int:
    """Sequences per step: given, or from tokens (on a CPU profile `fourd train`'s global batch)."""
    if v["global_seqs"]:
        return v["global_seqs"]
    if cluster.cpu:
        from fourd.config import TrainSection
    tokens = v["global_batch_tokens"] or (
        TrainSection().global_batch * seq if cluster.cpu else DEFAULT_BATCH_TOKENS
    )
    if tokens % seq:
        raise FourdError(
            f"a global batch of {tokens:g} tokens is not a whole number of {seq}-token sequences: "
            f"use a multiple of {seq}"
        )
    return int(tokens // seq)


def _even_batch(seqs: int, parts: int) -> int:
    """A batch given in tokens, to the nearest multiple of the replicas × microbatches that share it
    (said); fewer sequences than parts stay as they are, for the layout check to refuse."""
    even = round(seqs / parts) * parts if seqs >= parts else seqs
    if even != seqs:
        print(
            f"fourd: note: {seqs} sequences do not split into {parts} equal parts: planned with "
            f"{even}",
            file=sys.stderr,
        )
    return even


def resolve(model: ModelConfig, cluster: Cluster, values: Mapping[str, Any]) -> Request:
    """The one resolver: `values` names any of SETTINGS (text or typed; None or absent: open or
    defaulted)."""
    given = _values(values)
    if cluster.cpu:
        from fourd.config import DataSection, ParallelSection
    seq = given["seq"] or (DataSection().seq_len if cluster.cpu else model.max_seq)
    seq_parallel = given["sequence_parallel"]
    if seq_parallel is None:
        seq_parallel = ParallelSection().sequence_parallel if cluster.cpu else True
    layout, gpus = _layout_and_gpus(given)
    global_seqs = _batch(given, seq, cluster)
    schedule = given["schedule"] or ("interleaved" if (given["virtual_stages"] or 1) > 1 else None)
    check_stages(
        schedule or "interleaved", 2, 1, given["virtual_stages"] or 1
    )  # with or without a layout
    fixed = {k: given[k] for k in OPEN} | {"schedule": schedule, "sequence_parallel": seq_parallel}
    fixed["hsdp_replicas"] = given["hsdp_replicas"] or 1
    open_ = tuple(
        name.replace("_", " ")
        for name in OPEN
        if fixed[name] is None and (schedule in (None, "interleaved") or name != "virtual_stages")
    )
    if layout is not None and not given["global_seqs"]:
        global_seqs = _even_batch(global_seqs, layout.dp * (fixed["microbatches"] or 1))
    # name what is wrong with the user's own settings before searching the rest
    if layout is not None:
        layout_check(model, _pinned_parallelism(layout, fixed), seq, global_seqs)
    stack = load_stack(given["stack"] or DEFAULT_STACK)
    _note_beyond_stack(stack, schedule, fixed["zero"], layout)
    compiled = _compiled(cluster, stack, given)
    if compiled and given["compiled"] is None:
        open_ += ("compile",)
    if given["tp_overlap"] and not seq_parallel and layout is not None and layout.tp > 1:
        raise FourdError(
            "TP overlap runs with sequence parallelism only (it overlaps SP's all-gathers and "
            "reduce-scatters with the GEMMs): add --sequence-parallel on or drop --tp-overlap on"
        )
    _check_precision(given["precision"], cluster)
    base = Job(
        model=model,
        cluster=cluster,
        par=Parallelism(layout=Layout()),
        seq=seq,
        global_seqs=global_seqs,
        precision=given["precision"],
        compiled=compiled,
        attention=given["attention"] or "flash",
        pipeline_comm=given["pipeline_comm"] or stack.pipeline_comm,
        stack=given["stack"] or DEFAULT_STACK,
        tp_overlap=given["tp_overlap"],
        dp_overlap=given["dp_overlap"],
        fused_kernels=given["fused_kernels"],
        shared_kv=given["shared_kv"],
        fused_attention=given["fused_attention"],
    )
    return Request(
        base=base, gpus=gpus, fixed=fixed, open=open_, train_tokens=given["train_tokens"]
    )


def _check_precision(precision: str | None, cluster: Cluster) -> None:
    """FourdError for FP8 on a profile whose GPU has no FP8 tensor cores (no `fp8_peak_tflops`: A100,
    CPU profiles)."""
    if precision == FP8 and not (cluster.gpu.fp8_peak_tflops and cluster.gpu.sms):
        raise FourdError(
            f"--dtype fp8: the {cluster.gpu.name} of profile {cluster.name} has no FP8 tensor cores "
            "(its profile gives no fp8_peak_tflops): plan with --dtype bf16, or on a profile of an "
            f"FP8 GPU ({', '.join(fp8_presets())})"
        )


def fp8_presets() -> list[str]:
    """The cluster presets whose GPU has FP8 tensor cores (an `fp8_peak_tflops`)."""
    return [name for name in cluster_presets() if load_cluster(name).gpu.fp8_peak_tflops]


def _layout_and_gpus(given: dict[str, Any]) -> tuple[Layout | None, int]:
    """The layout (None: searched) and the GPU count, the one given or the layout's product;
    refused when neither is given or the two disagree."""
    layout, gpus = given["layout"], given["gpus"]
    if layout is None and gpus is None:
        raise FourdError("give the number of GPUs or a layout (its product is the number of GPUs)")
    gpus = gpus or layout.world
    if layout is not None and layout.world != gpus:
        raise FourdError(
            f"layout {layout} uses {layout.world} GPUs but {gpus} are asked: make the product of "
            f"the degrees equal {gpus}"
        )
    return layout, gpus


def _pinned_parallelism(layout: Layout, fixed: dict[str, Any]) -> Parallelism:
    """The user's layout with the settings they pinned and defaults for the open ones, to check
    before the search: HSDP shards with ZeRO 3 unless told otherwise."""
    zero = fixed["zero"]
    if zero is None:
        zero = 3 if fixed["hsdp_replicas"] > 1 else 0
    return Parallelism(
        layout=layout,
        schedule=fixed["schedule"] or "1f1b",
        microbatches=fixed["microbatches"] or 1,
        virtual_stages=fixed["virtual_stages"] or 1,
        zero=zero,
        recompute=fixed["recompute"] or "none",
        sequence_parallel=fixed["sequence_parallel"],
        hsdp_replicas=fixed["hsdp_replicas"],
    )


def _compiled(cluster: Cluster, stack: Stack, given: dict[str, Any]) -> bool:
    """Whether blocks are compiled: as given, else yes (faster, keeping less) except on a CPU
    profile (it predicts `fourd train`, which runs eager) and on a stack with fused kernels of
    its own (nothing left to compile)."""
    if given["compiled"] is not None:
        return given["compiled"]
    fused = switch(stack, "fused_kernels", given["fused_kernels"])
    return not (cluster.cpu or fused)


def _note_beyond_stack(stack, schedule: str | None, zero: int | None, layout) -> None:
    """Say so (one `fourd: note:` line) when a pinned layout, schedule or ZeRO stage is one the
    stack does not run: it is planned as asked; the open settings keep to the stack's. Without a layout a
    pinned schedule is read as meant for a pipeline, a pinned ZeRO stage as without one."""
    gaps = (
        stack.lacks(1, layout=layout),
        stack.lacks(layout.pp if layout is not None else 2, schedule=schedule),
        stack.lacks(layout.pp if layout is not None else 1, zero=zero),
    )
    reason = " and ".join(gap for gap in gaps if gap)
    if reason:
        print(f"fourd: note: the {stack.name} stack {reason}: planned as asked", file=sys.stderr)


def plans(req: Request, top: int | None = None) -> list[Plan]:
    """Every configuration the request allows in the search's order (fourd.plan.search.ranked: those
    that fit with the allocator's cache, then those that fit by emptying it, fastest first), the
    first `top` only when given; FourdError when there is none."""
    return ranking(req, top).plans


def ranking(req: Request, top: int | None = None) -> Ranking:
    """The search's ranking of every configuration the request allows (fourd.plan.search.rank:
    its first `top` plans only, when given, found without timing every configuration); FourdError
    when there is none."""
    found = rank(req.base, req.gpus, req.fixed, req.open, top)
    if not found.plans:
        base, microbatches = req.base, req.fixed["microbatches"]
        in_microbatches = the_microbatches = ""
        if microbatches:
            in_microbatches = f" in {microbatches} microbatches per replica"
            the_microbatches = ", the microbatches"
        raise FourdError(
            f"no configuration of {req.gpus} GPUs runs this model with {base.seq}-token sequences "
            f"and {base.global_seqs} sequences per step{in_microbatches}: change the number of "
            f"GPUs, the sequence length{the_microbatches} or the global batch"
        )
    return found


def best_plan(
    model: ModelConfig, cluster: Cluster | str, gpus: int, seq: int, global_seqs: int, fixed=None
) -> Plan:
    """The fastest plan that fits with the allocator's cache, else the fastest that fits by emptying
    it (the smallest if none fits) for `gpus` GPUs; `fixed` pins settings by their SETTINGS names (a
    layout as a Layout or its text), the rest are searched."""
    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    values = {**(fixed or {}), "gpus": gpus, "seq": seq, "global_seqs": global_seqs}
    return plans(resolve(model, cluster, values), top=1)[0]


def rank_peak_memory_gb(
    model: ModelConfig, cluster: Cluster | str, par: Parallelism, seq: int, global_seqs: int
):
    """GB (10^9 bytes) the fullest GPU holds at its peak: tensors, the allocator's cache and the
    runtime's reserve; FourdError if the configuration cannot run."""
    from fourd.plan.memory import GB, peak_memory

    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    layout_check(model, par, seq, global_seqs)
    return peak_memory(Job(model, cluster, par, seq, global_seqs))[1].held / GB
