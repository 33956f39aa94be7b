"""Show a model preset's dimensions and parameter count (counted as the torch model allocates them,
which the tests check on the meta device; nothing is built).

examples:
  fourd model info llama3-405b
  fourd model info debug --json
"""

from __future__ import annotations

import json

from fourd.errors import si
from fourd.model.config import get_preset


def add_arguments(parser):
    parser.add_argument(
        "preset", help="model preset: debug, small, llama3-8b, llama3-70b, llama3-405b"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    cfg = get_preset(args.preset)
    info = {"preset": args.preset, "params": cfg.params(), **cfg.to_dict()}
    info |= {
        "non_embedding_params": cfg.non_embedding_params(),
        "flops_per_token_at_max_seq": cfg.flops_per_token(cfg.max_seq),
    }
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(map(len, info))
    for key, value in info.items():
        text = str(value)
        if isinstance(value, int) and not isinstance(value, bool):
            text = f"{value:,}"
        if key.endswith("params"):
            text += f" ({si(value)})"
        print(f"{key:<{width}}  {text}")
    return 0
