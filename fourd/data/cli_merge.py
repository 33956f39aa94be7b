"""Join the task folders of `fourd data prepare --task I --tasks N` into one prepared dataset.

The merged stream is the one a single `fourd data prepare` of the same sources writes: the shares
are contiguous and in order. Its manifest lists the tasks' shards where they lie (docs/data.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fourd.data.tasks import merge
from fourd.errors import FourdError, plural


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="the --out of the tasks")
    p.add_argument("--holdout-fraction", type=float, default=0.01, metavar="F")


def run(args) -> int:
    if not 0 <= args.holdout_fraction < 0.5:
        raise FourdError(f"--holdout-fraction {args.holdout_fraction} must be in [0, 0.5)")
    out = Path(args.dir).expanduser().resolve()
    manifest = merge(out, args.holdout_fraction)
    shards = plural(len(manifest["shards"]), "shard")
    print(f"{out}: {plural(manifest['tokens'], 'token')} in {shards}")
    return 0
