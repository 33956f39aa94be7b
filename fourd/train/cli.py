"""Train a Llama-style model with 4D parallelism.

Started directly, fourd launches its own local workers (one per rank of the layout) through
PyTorch's elastic launcher; started under torchrun it runs as that worker, so the same command trains
across nodes. Same seed, same data order and same initial weights at any layout.

examples:
  fourd train                                         # the `small` model on the standard library, 1 rank
  fourd train --model debug --steps 30 --seed 0
  fourd train --model debug --layout tp=2,pp=2,dp=2 --schedule 1f1b --microbatches 4
  fourd train --config configs/run.toml --train.lr=1e-3 --data.seq_len=512
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m fourd train --model small --layout tp=2,pp=2,dp=2

config keys (--section.key=value): model.preset|layers|dim|ffn|heads|kv_heads|vocab|max_seq,
  data.path|tokenizer|seq_len|cache_dir|holdout_fraction, train.steps|global_batch|lr|min_lr|
  warmup_steps|weight_decay|beta1|beta2|grad_clip|seed|dtype|log_every|timeout_s,
  parallel.layout|schedule|microbatches|virtual_stages|zero|hsdp_replicas|recompute|sequence_parallel,
  checkpoint.interval|keep|async_save, fault.kill_rank|at_step|hang_rank, run.dir|max_restarts|trace
  (dashes and underscores are the same in keys: --fault.kill-rank 5 --fault.at-step 7)

fault injection (tests, demos): --fault.kill-rank R --fault.at-step S sends SIGKILL to rank R at step S
  of the first attempt; --fault.hang-rank R hangs it instead (caught by train.timeout_s); the environment
  variable FOURD_FAULT_KILL_IN_SAVE=R@S kills rank R while it writes the checkpoint of step S.
"""

from __future__ import annotations

import argparse

# short flag -> config key
FLAGS = {
    "model": "model.preset",
    "layout": "parallel.layout",
    "schedule": "parallel.schedule",
    "microbatches": "parallel.microbatches",
    "virtual_stages": "parallel.virtual_stages",
    "steps": "train.steps",
    "seed": "train.seed",
    "run_dir": "run.dir",
    "max_restarts": "run.max_restarts",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml", help="a TOML file of [section] keys")
    p.add_argument("--model", metavar="PRESET", help="debug, small, llama3-8b, llama3-70b, llama3-405b")
    p.add_argument("--layout", help="e.g. tp=2,cp=1,pp=2,dp=2 (omitted dimensions are 1)")
    p.add_argument("--schedule", help="pipeline schedule: gpipe, 1f1b, interleaved, zero-bubble")
    p.add_argument("--microbatches", type=int, metavar="M", help="microbatches per step")
    p.add_argument(
        "--virtual-stages", dest="virtual_stages", type=int, metavar="V", help="stages per pipeline rank (interleaved)"
    )
    p.add_argument("--steps", type=int, metavar="N")
    p.add_argument("--seed", type=int, metavar="S")
    p.add_argument("--run-dir", dest="run_dir", metavar="DIR", help="metrics.jsonl, TensorBoard, checkpoints")
    p.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=int,
        metavar="R",
        help="restart all workers from the newest checkpoint up to R times",
    )


# `--section.key=value` words reach run() as args._unknown (see fourd.cli).
ACCEPTS_OVERRIDES = True


def prepare(args):
    """Everything that can fail on bad input, done before any worker starts."""
    from fourd.config import build_config, model_config, parallelism
    from fourd.data.dataset import prepare as prepare_data
    from fourd.data.dataset import split
    from fourd.layout import check

    cfg = build_config(args.config, {FLAGS[k]: getattr(args, k) for k in FLAGS}, list(getattr(args, "_unknown", [])))
    mcfg = model_config(cfg)
    par = parallelism(cfg)
    check(mcfg, par, cfg.data.seq_len, cfg.train.global_batch)
    from fourd.errors import FourdError

    if par.recompute != "none":
        raise FourdError(f"parallel.recompute = {par.recompute!r} is not implemented yet: use none")
    layout = par.layout
    cache = prepare_data(cfg.data.path, cfg.data.tokenizer, cfg.data.cache_dir)
    split(cache.tokens, cfg.data.seq_len, cfg.data.holdout_fraction)  # one sequence must fit: refused before launch
    if cache.vocab_size > mcfg.vocab:
        from fourd.errors import FourdError

        raise FourdError(
            f"the tokenizer has {cache.vocab_size} ids but the model's vocabulary is {mcfg.vocab}: "
            f"set --model.vocab={cache.vocab_size} or use another tokenizer"
        )
    return cfg, layout, cache


def run(args) -> int:
    import os

    from fourd.config import fourd_home
    from fourd.train.launch import launch_local, under_torchrun
    from fourd.train.metrics import device_peak_flops

    cfg, layout, cache = prepare(args)
    import torch

    device_type = "cuda" if torch.cuda.is_available() and cfg.train.dtype != "fp32" else "cpu"
    from fourd.train.worker import worker_entry

    peak, source = device_peak_flops(device_type, fourd_home())
    if under_torchrun():
        worker_entry(cfg.to_dict(), cache, peak, source)
        return 0
    os.makedirs(cfg.run.dir, exist_ok=True)
    return launch_local(layout.world, cfg.run.max_restarts, worker_entry, cfg.to_dict(), cache, peak, source)
