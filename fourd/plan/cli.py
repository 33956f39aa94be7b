"""Predict memory per GPU, step time, tokens/s and MFU of training a model on a cluster with a 4D layout,
or search every layout for the fastest that fits. Pure Python: answers in well under a second.

Settings left out (schedule, virtual stages, microbatches, ZeRO stage, recomputation, even the layout)
are chosen by the planner, fastest that fits, and the report names them.

examples:
  fourd plan --model llama3-405b --cluster llama3-h100 --gpus 16384 --layout tp=8,pp=16,dp=128 \\
             --seq 8192 --global-batch-tokens 16M --schedule interleaved
  fourd plan --model llama3-405b --cluster llama3-h100 --gpus 16384 --seq 8192 --search --json
  fourd plan --model-spec layers=96,dim=12288,ffn=49152,heads=96,vocab=51200,mlp=gelu \\
             --cluster selene-a100 --gpus 1024 --layout tp=8,pp=16,dp=8 --seq 2048 --global-batch-tokens 3M
  fourd plan --model small --cluster local --layout tp=2,dp=2 --seq 256 --global-batch-tokens 8192
  fourd plan --model llama3-405b --cluster llama3-h100 --gpus 16384 --layout tp=8,pp=16,dp=128 --train-tokens 15.6T

Cluster profiles: fourd/plan/clusters/*.toml (llama3-h100, dgx-h100, dgx-h200, selene-a100), and
$FOURD_HOME/clusters/<name>.toml (`fourd calibrate` writes `local`), or a path; see docs/planner.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from fourd.errors import FourdError
from fourd.layout import PRECISIONS, Layout
from fourd.model.config import ModelConfig
from fourd.plan.cluster import Cluster
from fourd.schedules import SCHEDULES

_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "B": 1e9, "T": 1e12}
# Defaults for GPU clusters. argparse hands back these very objects when a flag is absent, so `run` can
# tell "left out" from "given" and default differently on a CPU profile, while other commands that share
# these flags (`fourd sim step`) read the plain values.
DEFAULT_BATCH = "".join("16M")
DEFAULT_SP = "".join("on")


def count(text: str) -> float:
    """`16777216`, `16M` (K, M, G binary, for batch sizes: 16M = 2^24), `15.6T` (B, T decimal, for budgets), `4e6`."""
    t = str(text).strip()
    try:
        if t and t[-1].upper() in _SUFFIX:
            return float(t[:-1]) * _SUFFIX[t[-1].upper()]
        return float(t)
    except ValueError:
        raise FourdError(f"{text!r} is not a count: write e.g. 16777216, 16M or 15.6T") from None


def add_arguments(p):
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--model", help="model preset: debug, small, llama3-8b, llama3-70b, llama3-405b (default llama3-405b)"
    )
    g.add_argument(
        "--model-spec", help="a model by its dimensions: layers=,dim=,ffn=,heads=,kv_heads=,vocab=[,mlp=gelu]"
    )
    p.add_argument("--cluster", default="llama3-h100", help="cluster profile name or .toml path (default llama3-h100)")
    p.add_argument("--gpus", type=int, help="number of GPUs (default: the layout's product)")
    p.add_argument("--layout", help="tp=8,cp=1,pp=16,dp=64 (omitted dimensions are 1; default: searched)")
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule")
    p.add_argument("--microbatches", type=int, help="microbatches per DP replica per step")
    p.add_argument("--virtual-stages", type=int, help="pipeline stages per rank (interleaved schedule)")
    p.add_argument(
        "--seq",
        type=int,
        help="sequence length in tokens (default: the model's max_seq; on a CPU profile `fourd train`'s data.seq_len)",
    )
    p.add_argument(
        "--global-batch-tokens",
        default=DEFAULT_BATCH,
        help="tokens per optimizer step (default 16M = "
        "16,777,216, Llama 3's; on a CPU profile `fourd train`'s global batch)",
    )
    p.add_argument("--recompute", choices=("none", "selective", "full"), help="activation recomputation")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage of the data-parallel sharding")
    p.add_argument(
        "--sequence-parallel",
        choices=("on", "off"),
        default=DEFAULT_SP,
        help="sequence parallelism with TP (default on; on a CPU profile `fourd train`'s default, off)",
    )
    p.add_argument("--dtype", choices=PRECISIONS, help="training precision (default: the cluster profile's)")
    p.add_argument("--train-tokens", help="token budget of the whole run, e.g. 15.6T, for training_days")
    p.add_argument("--search", action="store_true", help="rank every valid configuration; report the best and the top")
    p.add_argument("--top", type=int, default=10, help="candidates listed by --search (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Inputs:
    model: ModelConfig
    cluster: Cluster
    seq: int
    global_seqs: int
    layout: Layout | None
    gpus: int
    train_tokens: float | None
    sequence_parallel: bool


def resolve_inputs(args) -> Inputs:
    """The run these flags describe, defaults filled in; shared by the commands that take `fourd plan`'s
    flags (`add_arguments`), so that they read them alike."""
    from fourd.layout import parse_layout
    from fourd.model.config import get_preset, parse_model_spec
    from fourd.plan.cluster import load_cluster

    model = parse_model_spec(args.model_spec) if args.model_spec else get_preset(args.model or "llama3-405b")
    cluster = load_cluster(args.cluster)
    if args.dtype:
        cluster = replace(cluster, dtype=args.dtype)
    # A CPU profile (ranks share cores) describes this machine: default to what `fourd train` runs here.
    trainer = cluster.node.concurrent_ranks is not None
    if trainer:
        from fourd.config import DataSection, ParallelSection, TrainSection
    seq = args.seq or (DataSection().seq_len if trainer else model.max_seq)
    if seq < 2:
        raise FourdError(f"--seq {seq}: a sequence needs at least 2 tokens")
    tokens: float
    if trainer and args.global_batch_tokens is DEFAULT_BATCH:
        tokens = TrainSection().global_batch * seq
    else:
        tokens = count(args.global_batch_tokens)
    sp = args.sequence_parallel == "on"
    if trainer and args.sequence_parallel is DEFAULT_SP:
        sp = ParallelSection().sequence_parallel
    if tokens % seq or tokens < seq:
        raise FourdError(
            f"--global-batch-tokens {args.global_batch_tokens} is not a whole number of {seq}-token "
            f"sequences: use a multiple of {seq}"
        )
    layout = parse_layout(args.layout) if args.layout else None
    gpus = args.gpus or (layout.world if layout else None)
    if gpus is None:
        raise FourdError("give --gpus N or a --layout (its product is the number of GPUs)")
    if layout and layout.world != gpus:
        raise FourdError(
            f"--layout {layout} uses {layout.world} GPUs but --gpus is {gpus}: make the product of the degrees equal {gpus}"
        )
    return Inputs(
        model,
        cluster,
        seq,
        int(tokens // seq),
        layout,
        gpus,
        count(args.train_tokens) if args.train_tokens else None,
        sp,
    )


def run(args) -> int:
    from fourd.plan.report import plan_report, search_report
    from fourd.plan.search import Config, check, search

    inputs = resolve_inputs(args)
    model, cluster, seq, global_seqs = inputs.model, inputs.cluster, inputs.seq, inputs.global_seqs
    layout, gpus, train_tokens, sp = inputs.layout, inputs.gpus, inputs.train_tokens, inputs.sequence_parallel
    if args.virtual_stages and args.virtual_stages > 1 and args.schedule is None:
        args.schedule = "interleaved"
    fixed = {
        "layout": layout,
        "schedule": args.schedule,
        "microbatches": args.microbatches,
        "virtual_stages": args.virtual_stages,
        "zero": args.zero,
        "sequence_parallel": sp,
    }
    interleaving = args.schedule in (None, "interleaved")
    left_open = [
        name
        for name, value in (
            ("layout", layout),
            ("schedule", args.schedule),
            ("virtual stages", args.virtual_stages if interleaving else 1),
            ("microbatches", args.microbatches),
            ("zero", args.zero),
            ("recompute", args.recompute),
        )
        if value is None
    ]
    if layout:
        # Name what is wrong with the user's own settings before searching the rest.
        per_replica = global_seqs // layout.dp if global_seqs % layout.dp == 0 else 1
        sched = args.schedule or "1f1b"
        check(
            model,
            cluster,
            Config(
                layout,
                sched,
                args.microbatches or per_replica,
                args.virtual_stages or (2 if sched == "interleaved" and layout.pp > 1 else 1),
                1 if args.zero is None else args.zero,
                args.recompute or "none",
                sp,
            ),
            seq,
            global_seqs,
        )
    plans = search(model, cluster, gpus, seq, global_seqs, recompute=args.recompute, chosen=left_open, **fixed)
    if not plans:
        m = f" in {args.microbatches} microbatches per replica" if args.microbatches else ""
        raise FourdError(
            f"no configuration of {gpus} GPUs runs this model with {seq}-token sequences and "
            f"{global_seqs} sequences per step{m}: change --gpus, --seq, --global-batch-tokens"
            f"{' or --microbatches' if m else ''}"
        )
    if args.search:
        if args.json:
            print(
                json.dumps(
                    {
                        "best": plans[0].to_json(train_tokens),
                        "candidates": [p.to_json(train_tokens) for p in plans[: args.top]],
                        "searched": len(plans),
                        "fitting": sum(p.fits for p in plans),
                    }
                )
            )
        else:
            print(search_report(plans, args.top, train_tokens))
        return 0
    best = plans[0]
    if args.json:
        print(json.dumps(best.to_json(train_tokens)))
    else:
        print(plan_report(best, train_tokens))
    return 0
