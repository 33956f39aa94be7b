"""A checkpoint's step, layout, model and model digest, read from its manifest (no tensors loaded).

model_digest is a SHA-256 over every model tensor in full (unsharded) form in sorted-name order, so
the same weights give the same digest whatever layout saved them. --json prints the manifest's fields
(`step`, `layout`, `model`, `model_digest`, `train`, ...) plus `path`, `files` (count) and `bytes`.

examples:
  fourd ckpt info runs/latest/checkpoints/step-300
  fourd ckpt info runs/latest --json         # a run directory: its newest complete checkpoint
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from fourd.ckpt import store

    directory = store.resolve(args.dir)
    manifest = store.read_manifest(directory)
    info = {
        **{k: v for k, v in manifest.items() if k != "files"},
        "path": str(directory),
        "files": len(manifest["files"]),
        "bytes": sum(f["bytes"] for f in manifest["files"].values()),
    }
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    m = manifest["model"]
    rows = [
        ("path", str(directory)),
        ("step", str(manifest["step"])),
        ("layout", manifest["layout"]),
        (
            "model",
            f"{m.get('layers')} layers, dim {m.get('dim')}, heads {m.get('heads')}/{m.get('kv_heads')}, "
            f"vocab {m.get('vocab')}",
        ),
        ("model_digest", manifest["model_digest"]),
        ("files", f"{info['files']} ({info['bytes']:,} bytes)"),
    ]
    train = manifest.get("train")
    if isinstance(train, dict):
        rows.append(("train", ", ".join(f"{k} {v}" for k, v in sorted(train.items()))))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}   {v}" for k, v in rows))
    return 0
