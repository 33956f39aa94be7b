"""Check every shard and document index of a prepared dataset against its manifest (size, SHA-256).

Exit status 0 when all match; 1 and one line naming the first file that does not.
"""

from __future__ import annotations

import argparse
import sys

from fourd.data.verify import read_manifest, verify
from fourd.errors import FourdError, plural


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="a folder written by `fourd data prepare`")


def run(args) -> int:
    read_manifest(args.dir)  # no dataset there: bad input, exit status 2
    try:
        manifest = verify(args.dir)
    except FourdError as e:
        print(f"fourd: error: {e}", file=sys.stderr)
        return 1
    shards = plural(len(manifest["shards"]), "shard")
    print(f"{args.dir}: ok, {shards}, {plural(manifest['tokens'], 'token')} as the manifest says")
    return 0
