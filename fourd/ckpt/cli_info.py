"""A checkpoint's step, layout, model and model digest, read from its manifest (nothing is loaded).

model_digest is a SHA-256 over every model tensor in full (unsharded) form: the same weights give the
same digest whatever layout saved them. --json prints the manifest's fields (`step`, `layout`, `model`,
`model_digest`, `train`, ...) with `path`, `files` (count) and `bytes`.

examples:
  fourd ckpt info runs/demo/checkpoints/step-4
  fourd ckpt info runs/demo --json         # a run directory: its newest complete checkpoint
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
    files = manifest["files"].values()
    info = {**manifest, "path": str(directory), "files": len(files), "bytes": sum(f["bytes"] for f in files)}
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    m = store.model_config(str(directory), manifest["model"])
    train = manifest.get("train", {})
    rows = [
        ("path", str(directory)),
        ("step", str(manifest["step"])),
        ("layout", manifest["layout"]),
        ("model", f"{m.layers} layers, dim {m.dim}, heads {m.heads}/{m.kv_heads}, vocab {m.vocab}"),
        ("model_digest", manifest["model_digest"]),
        ("files", f"{info['files']} ({info['bytes']:,} bytes)"),
        ("train", ", ".join(f"{k} {v}" for k, v in sorted(train.items()) if not isinstance(v, dict))),
        ("data", ", ".join(f"{k} {v}" for k, v in sorted(train.get("data", {}).items()))),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}   {v}" for k, v in rows if v))
    return 0
