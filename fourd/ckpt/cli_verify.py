"""Check every file of a checkpoint against the SHA-256 sums in its manifest.

Exit status 0 when every file is present with the size and hash the manifest records; 2 naming the
first missing, truncated or altered file, or when the directory has no valid manifest. Nothing is
unpickled or loaded: only bytes are hashed.

examples:
  fourd ckpt verify runs/demo/checkpoints/step-4
  fourd ckpt verify runs/demo              # a run directory: its newest complete checkpoint
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="a checkpoint directory, or a run directory (its newest checkpoint)")


def run(args) -> int:
    from fourd.ckpt import store

    directory = store.resolve(args.dir)
    manifest = store.verify(directory)
    total = sum(f["bytes"] for f in manifest["files"].values())
    print(
        f"{directory}: OK, step {manifest['step']}, {len(manifest['files'])} files, {total:,} bytes, "
        f"model_digest {manifest['model_digest']}"
    )
    return 0
