"""Load and check runs.toml: published training runs, each pinned so that `fourd plan` can predict it.

    from validation.runs import load        # from a script in benchmarks/
    sources, runs = load()                   # {id: Source}, [Run, ...] in file order

    python benchmarks/validation/runs.py     # check the file and print what it covers

The schema, the sources and how each figure was derived: README.md beside this file. Pure Python (no torch).
"""

from __future__ import annotations

import sys
import types
import typing
from collections import Counter
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import tomllib

if __package__ in (None, ""):  # run as a script: make `fourd` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fourd.errors import FourdError
from fourd.layout import RECOMPUTE, ZERO_STAGES, Layout, Parallelism, check, parse_layout
from fourd.model.config import ModelConfig, get_preset, parse_model_spec
from fourd.plan.cluster import PLAN_PRECISIONS
from fourd.plan.cluster import preset_names as cluster_presets
from fourd.plan.stack import FUSED_ATTENTION, PIPELINE_COMM
from fourd.schedules import SCHEDULES

PATH = Path(__file__).with_name("runs.toml")
# The GPUs of the published runs. H100-HBM2e-96GB is the 500 W, 96 GB HBM2e H100 of Meta's Grand Teton hosts
# (torchtitan's benchmark files): neither the 80 GB SXM part nor the NVL part (README.md, "GPUs").
# GB200-186GB is a Blackwell GPU of a GB200 NVL72 rack (two a Grace Blackwell superchip); B200-180GB the
# Blackwell GPU of a DGX B200 or HGX B200 server (eight a server, 1,000 W). A800-SXM-80GB and H800-SXM-80GB are
# the export parts: an A100 80 GB's and an H100 SXM's compute and memory with NVLink at 400 GB/s.
GPUS = (
    "A100-SXM-40GB",
    "A100-SXM-80GB",
    "A800-SXM-80GB",
    "H100-SXM-80GB",
    "H800-SXM-80GB",
    "H100-HBM2e-96GB",
    "H200-SXM-141GB",
    "GB200-186GB",
    "B200-180GB",
)
# fused (FlashAttention family); the s x s scores in memory, soft-maxed by a fused kernel (Megatron)
# or by each op's own kernel (Hugging Face's eager attention); or not stated
ATTENTION_KERNELS = ("flash", "materialized", "eager", "unknown")
MEMORY_KINDS = ("allocated", "reserved")  # torch.cuda.max_memory_allocated / max_memory_reserved
# The software that ran a row (README.md, "Stacks"); rows with a first prediction must name theirs.
# the software stack of each row: the planner's presets (fourd/plan/stacks/; `lightning`: the
# flash-attention repository's training code, PyTorch Lightning DDP with ZeRO 1; `internevo`: InternLM's
# trainer and its Hybrid ZeRO), and a stack the planner has no preset of (Meta's own Llama 3 stack),
# planned with fourd's switches
STACKS = (
    "fourd",
    "fsdp",
    "fsdp2",
    "megatron-core",
    "nemo",
    "megatron-lm",
    "deepspeed",
    "paddle",
    "jax-xla",
    "meta-llama3",
    "nanotron",
    "lightning",
    "internevo",
)


@dataclass(frozen=True)
class Source:
    id: str
    title: str
    where: str
    first_prediction: str = ""  # "YYYY-MM-DD, commit abcdef0": when its rows were first predicted


@dataclass(frozen=True)
class Run:
    id: str
    source: str
    where: str
    gpu: str
    gpus: int
    layout: str
    schedule: str
    virtual_stages: int  # 0: not published, the planner chooses
    microbatch_seqs: int  # 0: not published, the planner chooses
    global_batch_seqs: int
    seq: int
    recompute: str
    sequence_parallel: bool
    zero: int
    precision: str
    compiled: bool
    attention_kernel: str
    flops_convention: str
    notes: str
    model: str = ""  # a fourd preset, or:
    model_spec: str = ""  # fourd's --model-spec syntax
    step_time_s_derived: float = 0.0  # seconds per optimizer step; required unless excluded
    hsdp_replicas: int = 1
    recompute_detail: str = (
        ""  # what the source's recomputation keeps, where it differs from fourd's mode
    )
    grad_reduce_dtype: str = ""
    nic_gbps_per_gpu: float = (
        0.0  # inter-node bandwidth per GPU as the source states it; 0: not stated
    )
    interconnect: str = ""
    # the fourd preset of the row's cluster where its source tells more than its GPU (whose preset
    # validate_planner.PRESETS names): Llama 3's pods, an AWS cluster's EFA network
    cluster: str = ""
    mfu: float = 0.0  # published metrics, in the source's own terms (0: not published)
    hfu: float = 0.0
    tflops_per_gpu: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    step_time_s: float = 0.0
    memory_gib: float = 0.0  # peak per GPU
    memory_kind: str = ""
    # "blocking": DeepSpeed's pipeline engine (sends wait; gradients reduced last); "": the stack's
    pipeline_comm: str = ""
    fit: bool = False
    stack: str = ""  # one of STACKS (required)
    # what the source states of its stack's overlap, where it differs from the stack's default
    tp_overlap: bool | None = None  # TP communication beside the GEMMs
    dp_overlap: bool | None = None  # DP reductions and gathers beside compute
    fused_kernels: bool | None = None  # the blocks' elementwise ops in fused kernels
    shared_kv: bool | None = None  # GQA's K/V heads read uncopied by the attention kernel
    fused_attention: str = ""  # the fused attention kernel where it differs from the stack's
    first_prediction_s: float = 0.0  # the planner's step time before any change for this source
    unstated: list[str] = field(
        default_factory=list
    )  # settings the source does not publish (values: best reading)
    excluded: str = ""  # why the planner cannot be judged on this row

    @property
    def model_config(self) -> ModelConfig:
        return get_preset(self.model) if self.model else parse_model_spec(self.model_spec)

    @property
    def parsed_layout(self) -> Layout:
        return parse_layout(self.layout)


def _typed(cls, table: dict, what: str):
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(table) - set(known))
    missing = [
        n
        for n, f in known.items()
        if n not in table and f.default is MISSING and f.default_factory is MISSING
    ]
    if unknown or missing:
        problem = f"unknown keys {unknown}" if unknown else f"missing keys {missing}"
        raise FourdError(
            f"runs.toml {what}: {problem}: the keys are those of the schema in README.md"
        )
    for name, value in table.items():
        hint = hints[name]
        if isinstance(hint, types.UnionType):  # `bool | None`: given, it is the bool
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        want = typing.get_origin(hint) or hint
        ok = isinstance(value, (int, float)) if want is float else isinstance(value, want)
        if not ok or (want in (int, float) and isinstance(value, bool)):
            raise FourdError(
                f"runs.toml {what}: {name} = {value!r} must be of type {want.__name__}"
            )
    return cls(**table)


def _choose(run: Run, name: str, allowed) -> None:
    if getattr(run, name) not in allowed:
        raise FourdError(
            f"runs.toml run {run.id!r}: {name} = {getattr(run, name)!r}: choose one of {list(allowed)}"
        )


def _check_first_prediction(run: Run, source: Source) -> None:
    """A first prediction is recorded on held-out rows of a source that says when it was made; once
    recorded it stays, on a row excluded later too (the harness counts the usable rows')."""
    what = f"runs.toml run {run.id!r}"
    if run.first_prediction_s and run.fit:
        raise FourdError(f"{what}: a first prediction is recorded on held-out rows only")
    if run.first_prediction_s and not source.first_prediction:
        raise FourdError(
            f"{what}: first_prediction_s needs the source's first_prediction "
            '("YYYY-MM-DD, commit abcdef0")'
        )


def _check_run(run: Run, sources: dict[str, Source]) -> None:
    what = f"runs.toml run {run.id!r}"
    if run.source not in sources:
        raise FourdError(f"{what}: source {run.source!r} is not a [[source]] id")
    if bool(run.model) == bool(run.model_spec):
        raise FourdError(f"{what}: give exactly one of model and model_spec")
    for name, allowed in (
        ("gpu", GPUS),
        ("schedule", SCHEDULES),
        ("recompute", RECOMPUTE),
        ("zero", ZERO_STAGES),
        ("precision", PLAN_PRECISIONS),
        ("attention_kernel", ATTENTION_KERNELS),
        ("pipeline_comm", ("", *PIPELINE_COMM)),
        ("fused_attention", ("", *FUSED_ATTENTION)),
    ):
        _choose(run, name, allowed)
    _choose(run, "memory_kind", MEMORY_KINDS if run.memory_gib else ("",))
    _choose(run, "stack", STACKS)
    _choose(run, "cluster", ("", *cluster_presets()))
    _check_first_prediction(run, sources[run.source])
    bad = set(run.unstated) - {f.name for f in fields(Run)}
    if bad:
        raise FourdError(f"{what}: unstated names unknown settings {sorted(bad)}")
    lay = run.parsed_layout
    if lay.world != run.gpus:
        raise FourdError(
            f"{what}: layout {run.layout} spans {lay.world} GPUs, not gpus = {run.gpus}"
        )
    if lay.pp == 1 and (run.schedule != "1f1b" or run.virtual_stages > 1):
        raise FourdError(
            f'{what}: without a pipeline write schedule = "1f1b" and virtual_stages = 0'
        )
    if run.excluded:
        return
    if run.step_time_s_derived <= 0:
        raise FourdError(
            f"{what}: step_time_s_derived must be positive (or the row excluded, with the reason)"
        )
    per_replica = run.global_batch_seqs // lay.dp
    micro = run.microbatch_seqs or 1
    if run.global_batch_seqs % lay.dp or per_replica % micro:
        raise FourdError(
            f"{what}: {run.global_batch_seqs} sequences do not split into dp={lay.dp} x microbatches"
        )
    par = Parallelism(
        layout=lay,
        schedule=run.schedule,
        microbatches=per_replica // micro,
        virtual_stages=run.virtual_stages or 1,
        zero=run.zero,
        recompute=run.recompute,
        sequence_parallel=run.sequence_parallel,
        hsdp_replicas=run.hsdp_replicas,
    )
    try:
        check(run.model_config, par, run.seq, run.global_batch_seqs // micro)
    except FourdError as e:
        raise FourdError(f"{what}: {e}") from None


def load(path: Path = PATH) -> tuple[dict[str, Source], list[Run]]:
    """The sources by id and the runs in file order; FourdError naming the row and the fix on any bad entry."""
    data = tomllib.loads(Path(path).read_text())
    extra = set(data) - {"source", "run"}
    if extra:
        raise FourdError(
            f"runs.toml: unknown top-level keys {sorted(extra)}: only [[source]] and [[run]] tables"
        )
    sources = {}
    for i, table in enumerate(data.get("source", [])):
        src = _typed(Source, table, f"source #{i + 1}")
        sources[src.id] = src
    runs = [
        _typed(Run, table, f"run {table.get('id', i + 1)!r}")
        for i, table in enumerate(data.get("run", []))
    ]
    twice = [k for k, n in Counter(r.id for r in runs).items() if n > 1]
    if twice or len(sources) != len(data.get("source", [])):
        raise FourdError(
            f"runs.toml: ids given twice: {twice or 'a source id'}; make each id unique"
        )
    for run in runs:
        _check_run(run, sources)
    usable = [r for r in runs if not r.excluded]
    fit = [r for r in runs if r.fit]
    if any(r.excluded for r in fit) or 3 * len(fit) > len(usable):
        raise FourdError(
            f"runs.toml: {len(fit)} fit rows: at most a third of the {len(usable)} usable rows, none excluded"
        )
    return sources, runs


def main() -> None:
    sources, runs = load()
    usable = [r for r in runs if not r.excluded]
    print(
        f"{len(runs)} rows ({len(usable)} usable, {len(runs) - len(usable)} excluded) from {len(sources)} sources; "
        f"{sum(r.fit for r in runs)} fit rows"
    )
    for key in ("source", "gpu", "recompute", "zero", "schedule"):
        print(
            f"  {key}: "
            + ", ".join(
                f"{k} {n}" for k, n in sorted(Counter(str(getattr(r, key)) for r in usable).items())
            )
        )
    dims = Counter(
        d for r in usable for d in ("tp", "cp", "pp", "dp") if getattr(r.parsed_layout, d) > 1
    )
    print("  parallel dims > 1: " + ", ".join(f"{d} {dims[d]}" for d in ("tp", "cp", "pp", "dp")))
    sizes = [r.model_config.params() / 1e9 for r in usable]
    print(
        f"  models {min(sizes):.2f}B to {max(sizes):.0f}B parameters; {sum(r.memory_gib > 0 for r in usable)} rows with memory"
    )


if __name__ == "__main__":
    try:
        main()
    except FourdError as e:
        sys.exit(f"fourd: error: {e}")
