"""A checkpoint's step, layout, model and model digest, from its manifest (nothing is loaded).

model_digest hashes the full model tensors, the same whatever layout saved them. --json prints the
manifest's fields with `path`, `files` (a count) and `bytes`.

examples:
  fourd ckpt info runs/demo/checkpoints/step-20     # after the run on docs/hf.md
  fourd ckpt info runs/demo --json         # a run directory: its newest complete checkpoint
"""

from __future__ import annotations

import json

from fourd.ckpt import store


def add_arguments(parser) -> None:
    parser.add_argument(
        "dir",
        metavar="DIR",
        help="a checkpoint directory, or a run directory (its newest checkpoint)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    directory = store.resolve(args.dir)
    manifest = store.read_manifest(directory)
    files = manifest["files"].values()
    info = {
        **manifest,
        "path": str(directory),
        "files": len(files),
        "bytes": sum(entry["bytes"] for entry in files),
    }
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    model = store.model_config(str(directory), manifest["model"])
    train = manifest.get("train", {})
    rows = {"path": directory, "step": manifest["step"], "layout": manifest["layout"]}
    rows["model"] = (
        f"{model.layers} layers, dim {model.dim}, heads {model.heads}/{model.kv_heads}, "
        f"vocab {model.vocab}"
    )
    rows |= {
        "model_digest": manifest["model_digest"],
        "files": f"{info['files']} ({info['bytes']:,} bytes)",
    }
    rows["train"] = ", ".join(
        f"{k} {value}" for k, value in sorted(train.items()) if not isinstance(value, dict)
    )
    rows["data"] = ", ".join(f"{k} {value}" for k, value in sorted(train.get("data", {}).items()))
    print("\n".join(f"{k:<12}   {value}" for k, value in rows.items() if value != ""))
    return 0
