"""Check every shard and document index of a prepared dataset against its manifest (size, SHA-256).

Exit status 0 when all match; 2 and one line naming the first file that does not (as `fourd ckpt
verify`).
"""

from __future__ import annotations

import argparse

from fourd.data.verify import verify
from fourd.errors import plural


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="a folder written by `fourd data prepare`")


def run(args) -> int:
    manifest = verify(args.dir)  # a FourdError: one line, exit status 2
    shards = plural(len(manifest["shards"]), "shard")
    print(f"{args.dir}: ok, {shards}, {plural(manifest['tokens'], 'token')} as the manifest says")
    return 0
