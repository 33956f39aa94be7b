"""Check every file of a checkpoint against the sizes and SHA-256 sums in its manifest (nothing is
loaded); exit status 2 names the first missing, truncated or altered file, or what is wrong with the
manifest.

examples:
  fourd ckpt verify runs/demo/checkpoints/step-20     # after the run on docs/hf.md
  fourd ckpt verify runs/demo              # a run directory: its newest complete checkpoint
"""

from __future__ import annotations

from fourd.ckpt import store


def add_arguments(p) -> None:
    p.add_argument(
        "dir",
        metavar="DIR",
        help="a checkpoint directory, or a run directory (its newest checkpoint)",
    )


def run(args) -> int:
    directory = store.resolve(args.dir)
    m = store.verify(directory)
    total = sum(f["bytes"] for f in m["files"].values())
    print(
        f"{directory}: OK, step {m['step']}, {len(m['files'])} files, {total:,} bytes, "
        f"model_digest {m['model_digest']}"
    )
    return 0
