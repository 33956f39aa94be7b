"""llm-analysis (PyPI `llm-analysis`, Cheng Li) beside fourd: its predicted step time for each validation row.

    from validation.llm_analysis_side import predict, unexpressible
    predict(runs)                 # {run_id: seconds per step} for the rows llm-analysis can express
    python benchmarks/validation/llm_analysis_side.py [--flops-efficiency 0.5]   # its errors, row by row

llm-analysis times a step as the step's FLOPs (forward, backward, recomputation; logits included) divided by
tp·pp GPUs at peak × flops_efficiency: no pipeline bubble, no communication, no compile or kernel effects. Its
default flops_efficiency is 1.0 (constant.FLOPS_EFFICIENCY); its own GPU configs give the peaks (A100 312,
H100 989 TFLOP/s). Install: pip install --no-deps llm-analysis==0.2.2 fire==0.5.0 six termcolor (README.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if __package__ in (
    None,
    "",
):  # run as a script: this folder's parent and the repository root on the path
    sys.path[:0] = [
        str(Path(__file__).resolve().parents[1]),
        str(Path(__file__).resolve().parents[2]),
    ]
    from validation.runs import Run, load
else:
    from .runs import Run, load

# Ours -> llm-analysis's GPU config names; the H200 and Grand Teton's 96 GB H100 have none there.
GPU_NAMES = {
    "A100-SXM-40GB": "a100-sxm-40gb",
    "A100-SXM-80GB": "a100-sxm-80gb",
    "H100-SXM-80GB": "h100-sxm-80gb",
}
# llm-analysis's ActivationRecomputation; fourd's per-op (every other matmul) has no match there: its selective
RECOMPUTE = {"none": 0, "selective": 1, "per-op": 1, "full": 2}


def _import():
    # llm-analysis imports transformers (and with it torch) only to fetch model configs from the Hugging Face
    # hub, which this module never asks for; a None entry makes that optional import fail fast.
    blocked = "transformers" not in sys.modules
    if blocked:
        sys.modules["transformers"] = None  # type: ignore[assignment]
    try:
        from llm_analysis.logger import logger

        logger.setLevel(
            logging.ERROR
        )  # before its config module warns that transformers is missing
        from llm_analysis import analysis, config
    finally:
        if blocked:
            del sys.modules["transformers"]
    return analysis, config


def unexpressible(run: Run) -> str:
    """Why llm-analysis cannot express this row ("" when it can)."""
    if run.gpu not in GPU_NAMES:
        return f"no llm-analysis GPU config for {run.gpu}"
    if run.parsed_layout.cp > 1:
        return "llm-analysis has no context parallelism"
    if run.precision == "fp8":
        return "llm-analysis has no FP8 training (its 8-bit configurations quantize for inference)"
    return ""


def _step_time(analysis, config, run: Run, flops_efficiency: float | None) -> float:
    m, lay = run.model_config, run.parsed_layout
    model = config.ModelConfig(
        name=run.id,
        num_layers=m.layers,
        n_head=m.heads,
        hidden_dim=m.dim,
        vocab_size=m.vocab,
        max_seq_len=run.seq,
        num_key_value_heads=m.kv_heads,
        ffn_embed_dim=m.ffn,
        expansion_ratio=m.ffn / m.dim,
    )
    par = config.ParallelismConfig(
        tp_size=lay.tp,
        pp_size=lay.pp,
        dp_size=lay.dp,
        sp_size=lay.tp if run.sequence_parallel else 1,
    )
    gpu = config.get_gpu_config_by_name(GPU_NAMES[run.gpu])
    dtype = config.get_dtype_config_by_name("w16a16e16")
    llm = analysis.LLMAnalysis(model, gpu, dtype, par, flops_efficiency=flops_efficiency)
    micro = (
        run.microbatch_seqs or 1
    )  # the FLOP count is linear in tokens: the split does not change the time
    summary = llm.training(
        batch_size_per_gpu=micro,
        global_batch_size=run.global_batch_seqs,
        seq_len=run.seq,
        activation_recomputation=analysis.ActivationRecomputation(RECOMPUTE[run.recompute]),
        ds_zero=analysis.DSZeRO(run.zero),
        flash_attn=run.attention_kernel == "flash",
        mlp_gated_linear_units=m.mlp == "swiglu",
    )
    return float(summary["latency_per_iter"])


def predict(runs: list[Run], flops_efficiency: float | None = None) -> dict[str, float]:
    """llm-analysis's step time (s) for every usable row it can express; {} when llm-analysis is not installed."""
    try:
        analysis, config = _import()
    except ImportError:
        return {}
    ok = [r for r in runs if not r.excluded and not unexpressible(r)]
    return {r.id: _step_time(analysis, config, r, flops_efficiency) for r in ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--flops-efficiency", type=float, help="llm-analysis's flops_efficiency (its default: 1.0)"
    )
    a = ap.parse_args()
    _, runs = load()
    pred = predict(runs, a.flops_efficiency)
    if not pred:
        sys.exit(
            "llm-analysis is not installed: pip install --no-deps llm-analysis==0.2.2 fire==0.5.0 six termcolor"
        )
    print(f"{'row':34} {'published s':>12} {'llm-analysis s':>15} {'error':>8}")
    errors = []
    for run in runs:
        if run.id in pred:
            err = pred[run.id] / run.step_time_s_derived - 1
            errors.append(abs(err))
            print(f"{run.id:34} {run.step_time_s_derived:12.4g} {pred[run.id]:15.4g} {err:+8.1%}")
    usable = [r for r in runs if not r.excluded]
    print(
        f"\n{len(pred)} of {len(usable)} usable rows; mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%}"
    )
    for run in usable:
        if unexpressible(run):
            print(f"  not expressed: {run.id}: {unexpressible(run)}")


if __name__ == "__main__":
    main()
