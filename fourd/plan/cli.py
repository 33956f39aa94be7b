"""Predict memory per GPU, step time, tokens/s and MFU of training a model on a cluster with a 4D
layout, or search every layout for the fastest that fits (with the allocator's cache first).
Settings left out (even the layout) are the planner's choice, fastest that fits, and the report
names them. Cluster profiles: presets (llama3-h100, dgx-h100, dgx-h200, aws-p5, grand-teton-h100,
hgx-h800, dgx-gb200, dgx-b200, dgx-a100-40gb, selene-a100, dgx-a800), $FOURD_HOME/clusters/NAME.toml
(`fourd calibrate` writes `local`), or a path; see docs/planner.md.

examples:
  fourd plan --model llama3-405b --cluster llama3-h100 --gpus 16384 --layout tp=8,pp=16,dp=128 \\
             --seq 8192 --global-batch-tokens 16M --schedule interleaved --train-tokens 15.6T
  fourd plan --model llama3-405b --cluster llama3-h100 --gpus 16384 --seq 8192 --search --json
  fourd plan --model-spec layers=96,dim=12288,ffn=49152,heads=96,vocab=51200,mlp=gelu \\
             --cluster selene-a100 --layout tp=8,pp=16,dp=8 --seq 2048 --global-batch-tokens 3M \\
             --pipeline-comm blocking
  fourd plan --model llama3-70b --cluster dgx-h100 --layout tp=8,pp=4,dp=16 --seq 8192 \\
             --stack nemo                                   # NeMo's switches
  fourd plan --anchor runs/X/anchor.json --layout tp=2,dp=2  # from a measured step
"""

from __future__ import annotations

import json

from fourd.plan.request import add_arguments, ranking, resolve_inputs

__all__ = ["add_arguments", "run"]


def run(args) -> int:
    from fourd.plan import intervals
    from fourd.plan.report import plan_report, search_json, search_report

    if args.anchor:  # anchored predictions: fourd.plan.anchor
        from fourd.plan.anchor import run_plan

        return run_plan(args)
    req = resolve_inputs(args)
    ranked = ranking(req, args.top if args.search else 1)
    plans = ranked.plans
    if args.search and args.json:
        listed = [plan.to_json(req.train_tokens) | intervals.json_keys(plan) for plan in plans]
        close = intervals.too_close(plans)
        print(json.dumps(search_json(listed, ranked) | {"too_close_to_call": close}))
    elif args.search:
        print(search_report(ranked, req.train_tokens))
        print("\n".join(intervals.search_lines(plans)))
    elif args.json:
        print(json.dumps(plans[0].to_json(req.train_tokens) | intervals.json_keys(plans[0])))
    else:
        print(plan_report(plans[0], req.train_tokens))
        print("\n".join(intervals.report_lines(plans[0])))
    return 0
