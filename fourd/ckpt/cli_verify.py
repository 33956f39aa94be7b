"""Check every file of a checkpoint against the sizes and SHA-256 sums in its manifest (nothing is
loaded); exit status 2 names the first missing, truncated or altered file, or what is wrong with the
manifest.

examples:
  fourd ckpt verify runs/demo/checkpoints/step-20     # after the run on docs/hf.md
  fourd ckpt verify runs/demo              # a run directory: its newest complete checkpoint
"""

from __future__ import annotations

from fourd.ckpt import store


def add_arguments(parser) -> None:
    parser.add_argument(
        "dir",
        metavar="DIR",
        help="a checkpoint directory, or a run directory (its newest checkpoint)",
    )


def run(args) -> int:
    directory = store.resolve(args.dir)
    manifest = store.verify(directory)
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    print(
        f"{directory}: OK, step {manifest['step']}, {len(manifest['files'])} files, "
        f"{total:,} bytes, model_digest {manifest['model_digest']}"
    )
    return 0
