"""Train a Llama-style model with 4D parallelism: one local worker per rank through PyTorch's elastic launcher, or
under torchrun the worker itself, across nodes. Same seed, data order and initial weights at any layout. A run gets
runs/<model>-<layout>-<time> (or --run-dir) with config.toml, metrics.jsonl, tensorboard/ and checkpoints/; Ctrl-C
or SIGTERM stops it at the next step with a checkpoint, and --resume continues it exactly.

examples:
  fourd train --model debug --steps 30                # one rank, seconds
  fourd train --model debug --layout tp=2,pp=2,dp=2 --schedule 1f1b --microbatches 4 --steps 3
  fourd train --config configs/run.toml --train.lr=1e-3 --eval.every 10
  fourd train --resume runs/debug-dp1-20260101-120000 --steps 60   # continue a stopped run, for longer
  fourd train --init-from ./Llama-3.2-1B --data.path notes.txt      # fine-tune from Hugging Face weights
  fourd train --model small --layout auto                          # the planner chooses the layout
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m fourd train --model small --layout tp=2,pp=2,dp=2 --run-dir /shared/runs/small

fault injection (tests, demos): --fault.kill-rank R --fault.at-step S sends SIGKILL to rank R at step S
of the first attempt; --fault.hang-rank R hangs it instead; FOURD_FAULT_KILL_IN_SAVE=R@S in the environment
kills rank R while it writes the checkpoint of step S.

config keys (--section.key=value, or [section] key = value in --config FILE.toml; - and _ alike in keys):"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import time
from pathlib import Path

from fourd.ckpt.store import checkpoints
from fourd.config import Config, build_config, fourd_home, load_toml, model_config, parallelism
from fourd.config import check as check_config
from fourd.data.dataset import absolute_mix, open_data
from fourd.errors import FourdError, plural, si
from fourd.hf.convert import load_weights
from fourd.layout import DIMS, check, parse_layout
from fourd.measure.peak import device_peak_flops
from fourd.model.config import PLANNER_ONLY_FIELDS
from fourd.train.auto import check_memory, choose, machine, use_cuda
from fourd.train.launch import attempt, launch_local, under_torchrun

# short flag -> config key
FLAGS = {
    "model": "model.preset",
    "steps": "train.steps",
    "seed": "train.seed",
    "init_from": "train.init_from",
}
FLAGS |= {k: f"parallel.{k}" for k in ("layout", "schedule", "microbatches", "virtual_stages")}
FLAGS |= {"run_dir": "run.dir", "max_restarts": "run.max_restarts"}
# What a resumed run keeps: the model, its data and the order of its samples.
KEPT = (
    "data.path",
    "data.tokenizer",
    "data.seq_len",
    "data.holdout_fraction",
    "data.mix",
    "train.global_batch",
    "train.seed",
)
# `--section.key=value` words reach run() as args._unknown (see fourd.cli).
ACCEPTS_OVERRIDES = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (p.description or "") + "".join(
        f"\n  [{s}] {', '.join(v)}" for s, v in Config().to_dict().items()
    )
    p.add_argument("--config", metavar="FILE.toml", help="a TOML file of [section] keys")
    p.add_argument(
        "--model", metavar="PRESET", help="debug, small, llama3-8b, llama3-70b, llama3-405b"
    )
    p.add_argument(
        "--layout",
        help="e.g. tp=2,cp=1,pp=2,dp=2 (omitted dimensions are 1), or auto: the planner's choice",
    )
    p.add_argument("--schedule", help="pipeline schedule: gpipe, 1f1b, interleaved, zero-bubble")
    p.add_argument("--microbatches", type=int, metavar="M", help="microbatches per step")
    p.add_argument(
        "--virtual-stages",
        dest="virtual_stages",
        type=int,
        metavar="V",
        help="stages per pipeline rank",
    )
    p.add_argument("--steps", type=int, metavar="N", help="the step to train up to")
    p.add_argument("--seed", type=int, metavar="S")
    p.add_argument(
        "--run-dir",
        dest="run_dir",
        metavar="DIR",
        help="default: a fresh runs/<model>-<layout>-<time>",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        metavar="DIR",
        help="continue the run in DIR (or --run-dir)",
    )
    p.add_argument(
        "--init-from", dest="init_from", metavar="PATH", help="start from a fourd or HF checkpoint"
    )
    p.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=int,
        metavar="R",
        help="restart failed workers R times",
    )


def _absolute(cfg) -> None:
    """Paths as absolute paths, so that the recorded configuration works from any directory."""
    for section, key in (
        ("data", "path"),
        ("data", "cache_dir"),
        ("train", "init_from"),
        ("data", "tokenizer"),
    ):
        value = getattr(getattr(cfg, section), key)
        if value and (key != "tokenizer" or Path(value).expanduser().is_file()):
            setattr(getattr(cfg, section), key, str(Path(value).expanduser().resolve()))
    if cfg.data.mix:
        cfg.data.mix = absolute_mix(cfg.data.mix)


def _resuming(args) -> tuple[Path | None, dict]:
    """(the run directory --resume names, its recorded configuration); (None, {}) for a new run."""
    if args.resume is None:
        return None, {}
    if (
        args.resume is not True
        and args.run_dir is not None
        and Path(args.resume) != Path(args.run_dir)
    ):
        raise FourdError(
            f"--resume {args.resume} and --run-dir {args.run_dir} name two runs: give one of them"
        )
    where = args.run_dir if args.resume is True else args.resume
    if not where or not Path(where).is_dir():
        raise FourdError(
            f"--resume {where}: no such run directory; `ls runs/` lists the runs"
            if where
            else "--resume needs the run: --resume DIR, or --run-dir DIR --resume"
        )
    run, record = Path(where), Path(where, "config.toml")
    if not record.is_file() and not checkpoints(run):
        raise FourdError(
            f"--resume {where}: nothing to resume there (no config.toml, no checkpoint): "
            "drop --resume"
        )
    return run, load_toml(record) if record.is_file() else {}


def _changes(have, asked) -> str:
    """'layers 4, not 8; dim 64, not 256': how model `asked` differs from model `have`."""
    a, h = asked.to_dict(), have.to_dict()
    return "; ".join(f"{k} {h[k]}, not {a[k]}" for k in h if h[k] != a[k])


def _check_kept(saved, cfg, mcfg, run_dir: Path) -> None:
    if model_config(saved) != mcfg:
        raise FourdError(
            f"--resume: the model differs from the run's ({_changes(model_config(saved), mcfg)})"
        )
    for key in KEPT:
        old, new = (getattr(getattr(c, key.split(".")[0]), key.split(".")[1]) for c in (saved, cfg))
        if old != new:
            raise FourdError(
                f"--resume: {key} = {new!r} contradicts the run's {old!r} "
                f"({run_dir}/config.toml): drop it, or start a new run without --resume"
            )


def _model_name(cfg) -> str:
    return Path(cfg.train.init_from).name if cfg.train.init_from else cfg.model.preset


def _check_run_dir(cfg, given: str | None) -> None:
    """Refuse a run directory that cannot be one or that holds another run (a fresh one is made at
    start)."""
    if given == "":
        raise FourdError(
            "--run-dir '' is empty: give a directory, or leave --run-dir out for a fresh one"
        )
    if not cfg.run.dir:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            raise FourdError("under torchrun, give --run-dir DIR: a directory every node can reach")
        return
    d = Path(cfg.run.dir)
    blocker = next((p for p in (d, *d.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise FourdError(
            f"run directory {d}: {blocker} is a file, not a directory: choose another --run-dir"
        )
    if (d / "checkpoints").exists() or (d / "metrics.jsonl").exists():
        raise FourdError(
            f"run directory {d} already holds a run: continue it with "
            f"`fourd train --resume {d}`, or choose another --run-dir (or leave it out for a "
            "fresh one)"
        )


def _configure(args):
    """The run's whole configuration and its model: flags over a resumed run's record or an
    --init-from model."""
    resumed, saved = _resuming(args)
    flags = {FLAGS[k]: getattr(args, k) for k in FLAGS}
    if resumed is not None:
        flags["run.dir"] = str(resumed)
    overrides, options = (
        list(args._unknown),
        [s for a in args._parser._actions for s in a.option_strings],
    )
    cfg = build_config(args.config, flags, overrides, saved, options)
    _absolute(cfg)
    source = None
    if cfg.train.init_from and resumed is None:
        source = load_weights(cfg.train.init_from, weights=False)[0]
    said = (
        args.model
        or any(w.startswith("--model.") for w in overrides)
        or "model" in load_toml(args.config or "")
    )
    if source is not None and not said:  # nothing said about the model: the source's
        dims = {k: v for k, v in source.to_dict().items() if k not in PLANNER_ONLY_FIELDS}
        cfg = build_config(args.config, flags, overrides, {"model": dims}, options)
        _absolute(cfg)
    mcfg = model_config(cfg)
    if source is not None and source != mcfg:
        raise FourdError(
            f"--init-from {cfg.train.init_from} holds another model ({_changes(source, mcfg)}): "
            "drop the model settings to train its model"
        )
    if resumed is not None:
        kept = Config.from_dict(saved or cfg.to_dict())
        _absolute(kept)  # a data.mix recorded relative (before fourd made it absolute) is kept
        _check_kept(kept, cfg, mcfg, resumed)
    return cfg, mcfg, resumed


def prepare(args):
    """Everything that can fail on bad input, done before any worker starts: (cfg, layout, cache,
    data record)."""
    cfg, mcfg, resumed = _configure(args)
    here = (
        machine(cfg) if cfg.parallel.layout == "auto" else None
    )  # (profile, devices, bytes per device)
    if here:
        choose(cfg, here[0], here[1])
        check_config(cfg)
    par = parallelism(cfg)
    check(mcfg, par, cfg.data.seq_len, cfg.train.global_batch)
    if par.hsdp and par.zero != 3:
        raise FourdError(
            f"parallel.hsdp_replicas = {par.hsdp_replicas} with ZeRO stage {par.zero}: fourd train "
            "runs HSDP with ZeRO 3 (FSDP2's replicated shards); set parallel.zero = 3, or "
            "parallel.hsdp_replicas = 1 (the planner plans ZeRO 1 and 2 within groups too)"
        )
    if cfg.train.fp8:
        from fourd.parallel.apply import check_fp8

        check_fp8(cfg)
    cluster, _, capacity = here or machine(cfg)
    check_memory(cfg, cluster, capacity)
    if resumed is None and attempt() == 0:
        _check_run_dir(cfg, args.run_dir)
    d = cfg.data
    cache = open_data(d)
    held = cache.stream(d.seq_len, cfg.train.seed, d.holdout_fraction).held_out_tokens
    if cache.vocab_size > mcfg.vocab:
        raise FourdError(
            f"the tokenizer has {cache.vocab_size} ids but the model's vocabulary is {mcfg.vocab}: "
            f"set --model.vocab={cache.vocab_size} or use another tokenizer"
        )
    if cache.vocab_size < mcfg.vocab:
        note = (
            f"the model's vocabulary ({mcfg.vocab:,}) is larger than the tokenizer's "
            f"({cache.vocab_size:,} ids)"
        )
        print(f"fourd train: note: {note}; the other rows are padding, never a target", flush=True)
    if cfg.eval.every and (held - 1) // d.seq_len < cfg.train.global_batch:
        raise FourdError(
            f"eval.every: the held-out tail has {plural(held, 'token')}, less than one batch of "
            f"{cfg.train.global_batch} x {d.seq_len + 1}: raise data.holdout_fraction or set "
            "eval.every = 0"
        )
    data = {"path": d.mix or d.path, "tokenizer": cache.tokenizer, "identity": cache.identity}
    return cfg, par.layout, cache, {**data, "source": cache.source, "tokens": cache.tokens}


def _start(cfg) -> None:
    """Create the run directory (a fresh, unique one when none is given) and write config.toml into
    it."""
    if not cfg.run.dir:
        lay = parse_layout(cfg.parallel.layout)
        tag = "-".join(f"{d}{getattr(lay, d)}" for d in DIMS if getattr(lay, d) > 1) or "dp1"
        stem = f"runs/{_model_name(cfg)}-{tag}-{time.strftime('%Y%m%d-%H%M%S')}"
        for n in itertools.count(1):  # two runs started in the same second get -2, -3, ...
            cfg.run.dir = stem + (f"-{n}" if n > 1 else "")
            with contextlib.suppress(FileExistsError):
                Path(cfg.run.dir).mkdir(parents=True)
                break
    try:
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(cfg.run.dir, f".config.toml.{os.getpid()}")
        tmp.write_text(cfg.to_toml())
        os.replace(tmp, Path(cfg.run.dir, "config.toml"))
    except OSError as e:
        raise FourdError(
            f"run directory {cfg.run.dir}: {e.strerror}: choose another --run-dir"
        ) from None


def run(args) -> int:
    cfg, layout, cache, data = prepare(args)
    from fourd.train.worker import torchrun_worker, worker_entry

    device = "cuda" if use_cuda(cfg) else "cpu"
    peak = device_peak_flops(device, fourd_home())
    if not under_torchrun() or os.environ.get("RANK") == "0":
        _start(cfg)
        model = f"{_model_name(cfg)} model, {si(model_config(cfg).params())} parameters"
        per_step = f"{cfg.train.global_batch} x {cfg.data.seq_len} tokens per step"
        where = f"layout {layout} ({plural(layout.world, 'rank')}, {device})"
        print(
            f"fourd train: {cfg.run.dir}: {model}, {where}, {per_step}, data: {cache.source}",
            flush=True,
        )
    if under_torchrun():
        torchrun_worker(cfg.to_dict(), cache, data, peak)
    # CPU workers fork from one process that imported torch and fourd.train.worker once; CUDA
    # workers spawn, each its own fresh interpreter
    preload = ("fourd.train.worker",) if device == "cpu" else ()
    return launch_local(
        layout.world,
        cfg.run.max_restarts,
        worker_entry,
        cfg.to_dict(),
        cache,
        data,
        peak,
        preload=preload,
    )
