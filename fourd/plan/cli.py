"""Predict memory per GPU, step time, tokens/s and MFU of training a model on a cluster with a 4D layout,
or search every layout for the fastest that fits. Pure Python: answers in well under a second.

Settings left out (schedule, virtual stages, microbatches, ZeRO stage, recomputation, even the layout)
are chosen by the planner, fastest that fits, and the report names them.

examples:
  fourd plan --model llama3-405b --cluster llama3-h100 --gpus 16384 --layout tp=8,pp=16,dp=128 \\
             --seq 8192 --global-batch-tokens 16M --schedule interleaved
  fourd plan --model llama3-405b --cluster llama3-h100 --gpus 16384 --seq 8192 --search --json
  fourd plan --model-spec layers=96,dim=12288,ffn=49152,heads=96,vocab=51200,mlp=gelu \\
             --cluster selene-a100 --gpus 1024 --layout tp=8,pp=16,dp=8 --seq 2048 --global-batch-tokens 3M
  fourd plan --model small --cluster local --layout tp=2,dp=2 --seq 256 --global-batch-tokens 8192
  fourd plan --model llama3-405b --cluster llama3-h100 --gpus 16384 --layout tp=8,pp=16,dp=128 --train-tokens 15.6T

Cluster profiles: fourd/plan/clusters/*.toml (llama3-h100, dgx-h100, dgx-h200, grand-teton-h100,
dgx-a100-40gb, selene-a100 (A100 80 GB)), and $FOURD_HOME/clusters/<name>.toml (`fourd calibrate` writes `local`),
or a path; see docs/planner.md.
"""

from __future__ import annotations

import json

from fourd.plan.request import add_arguments, plans, resolve_inputs

__all__ = ["add_arguments", "run"]


def run(args) -> int:
    from fourd.plan.report import plan_report, search_report

    req = resolve_inputs(args)
    found = plans(req)
    if args.search and args.json:
        out = {
            "best": found[0].to_json(req.train_tokens),
            "candidates": [p.to_json(req.train_tokens) for p in found[: args.top]],
            "searched": len(found),
            "fitting": sum(p.fits for p in found),
        }
        print(json.dumps(out))
    elif args.search:
        print(search_report(found, args.top, req.train_tokens))
    elif args.json:
        print(json.dumps(found[0].to_json(req.train_tokens)))
    else:
        print(plan_report(found[0], req.train_tokens))
    return 0
