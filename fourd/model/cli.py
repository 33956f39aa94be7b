"""Show a model preset's dimensions and parameter count; the model is built on the meta device, so
even llama3-405b needs no memory.

examples:
  fourd model info llama3-405b
  fourd model info debug --json
"""

from __future__ import annotations

import json

from fourd.errors import si


def add_arguments(p):
    p.add_argument("preset", help="model preset: debug, small, llama3-8b, llama3-70b, llama3-405b")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from fourd.model.config import get_preset

    cfg = get_preset(args.preset)
    import torch  # noqa: F401  (after the preset check, so a bad name answers instantly)

    from fourd.model.llama import build_model

    model = build_model(cfg, device="meta")
    params = sum(p.numel() for p in model.parameters())
    info = {
        "preset": args.preset,
        "params": params,
        **cfg.to_dict(),
        "non_embedding_params": cfg.non_embedding_params(),
        "flops_per_token_at_max_seq": cfg.flops_per_token(cfg.max_seq),
    }
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(map(len, info))
    for k, v in info.items():
        text = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
        print(f"{k:<{width}}  {text}" + (f" ({si(v)})" if k.endswith("params") else ""))
    return 0
