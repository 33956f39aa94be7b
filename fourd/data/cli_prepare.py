"""Tokenize a corpus once into memory-mappable token shards, a document index and a manifest.

Sources: text files, folders, JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet files or folders, and
Hugging Face `datasets` folders written by save_to_disk. `fourd train --data.path DIR` reads the
result.

examples:
  fourd data prepare corpus.jsonl.zst --tokenizer tokenizer.json --out data/corpus
  fourd data prepare shards/ --tokenizer byte --eod-id 256 --out data/bytes
  fourd data prepare shards/ --tokenizer tokenizer.json --out data/big --task 3 --tasks 8
  fourd data merge data/big                      # after all 8 tasks: one dataset of their shards
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fourd.data.prepare import SHARD_TOKENS, Request, prepare_into
from fourd.data.sources import list_sources
from fourd.data.tasks import task_folder, task_sources
from fourd.errors import FourdError, plural


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", metavar="SRC", help="files or folders, in this order")
    p.add_argument("--tokenizer", required=True, help="byte, or a tokenizer.json / tiktoken file")
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared dataset's folder")
    p.add_argument("--text-field", default="text", help="JSONL field or column with the text")
    p.add_argument("--eod-id", type=int, help="end-of-document id (default: the tokenizer's own)")
    p.add_argument("--workers", type=int, default=0, help="tokenizer threads (default: all cores)")
    p.add_argument("--holdout-fraction", type=float, default=0.01, metavar="F")
    p.add_argument("--task", type=int, default=0, metavar="I", help="this task's number, 0 .. N-1")
    p.add_argument("--tasks", type=int, default=1, metavar="N", help="tasks sharing the sources")
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=SHARD_TOKENS,
        metavar="T",
        help=f"a shard closes at the first document end past T tokens (default {SHARD_TOKENS:,})",
    )


def run(args) -> int:
    if not 0 <= args.holdout_fraction < 0.5:
        raise FourdError(f"--holdout-fraction {args.holdout_fraction} must be in [0, 0.5)")
    if args.shard_tokens < 1:
        raise FourdError(f"--shard-tokens {args.shard_tokens} must be at least 1")
    if args.workers < 0:
        raise FourdError(f"--workers {args.workers} must be 0 (every core) or more")
    if not 0 <= args.task < args.tasks:
        raise FourdError(f"--task {args.task} must be in 0 .. --tasks - 1 = {args.tasks - 1}")
    sources = list_sources(args.sources)
    out = Path(args.out).expanduser().resolve()
    label = " ".join(args.sources)
    if args.tasks > 1:
        sources = task_sources(sources, args.task, args.tasks)
        out = task_folder(out, args.task, args.tasks)
    tokenizer = args.tokenizer
    if Path(tokenizer).expanduser().is_file():  # recorded as an absolute path: usable from anywhere
        tokenizer = str(Path(tokenizer).expanduser().resolve())
    request = Request(
        sources=tuple(sources),
        tokenizer=tokenizer,
        label=label,
        text_field=args.text_field,
        eod_id=args.eod_id,
        holdout_fraction=args.holdout_fraction,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
    )
    manifest = prepare_into(request, out, label, allow_empty=args.tasks > 1)
    tokens, documents = manifest["tokens"], manifest["documents"]
    print(f"{out}: {plural(tokens, 'token')}, {plural(documents, 'document')}")
    return 0
