"""What a prepared dataset holds: tokens, documents, tokenizer, sources, shards, the held-out share.

examples:
  fourd data info data/corpus
  fourd data info data/corpus --json
"""

from __future__ import annotations

import argparse
import json

from fourd.data.verify import read_manifest
from fourd.errors import plural


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="a folder written by `fourd data prepare`")
    p.add_argument("--json", action="store_true", help="the figures as one JSON object")


def summary(manifest: dict) -> dict:
    holdout = manifest["holdout"]
    return {
        "tokens": manifest["tokens"],
        "documents": manifest["documents"],
        "tokenizer": manifest["tokenizer"],
        "vocab_size": manifest["vocab_size"],
        "dtype": manifest["dtype"],
        "eod": manifest["eod"],
        "sources": len(manifest["sources"]),
        "source_bytes": sum(s["size"] for s in manifest["sources"]),
        "shards": len(manifest["shards"]),
        "holdout": holdout,
        "held_out_share": holdout["tokens"] / max(manifest["tokens"], 1),
    }


def run(args) -> int:
    manifest = read_manifest(args.dir)
    figures = summary(manifest)
    if args.json:
        print(json.dumps(figures))
        return 0
    tok, eod, holdout = figures["tokenizer"], figures["eod"], figures["holdout"]
    unit = "whole documents" if holdout["whole_documents"] else "tokens of the last document"
    rows = {
        "tokens": f"{figures['tokens']:,} ({figures['dtype']})",
        "documents": f"{figures['documents']:,}",
        "tokenizer": f"{tok['spec']} ({tok['identity'][:23]}), {figures['vocab_size']:,} ids",
        "end of doc": f"ids {eod['ids']} ({eod['from']})",
        "sources": f"{plural(figures['sources'], 'file')}, {figures['source_bytes']:,} bytes",
        "shards": plural(figures["shards"], "shard"),
        "held out": f"{figures['held_out_share']:.2%}: {holdout['tokens']:,} tokens, {unit}",
    }
    print("\n".join(f"{name:<11} {value}" for name, value in rows.items()))
    return 0
