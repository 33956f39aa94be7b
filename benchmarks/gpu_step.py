"""`fourd train` on the 1.5B shape beside Hugging Face's LlamaForCausalLM (SDPA), eager and compiled, in one run.

    python benchmarks/gpu_step.py                  # a CUDA GPU: 16 layers, dim 2048, ffn 8192, 32 heads, 8 KV heads,
                                                   # vocabulary 128,256, batch 8 x 2,048, BF16 autocast over FP32 weights
    python benchmarks/gpu_step.py --tiny [--eager] # anywhere (CPU, FP32): a tiny shape, to show that the script runs
    python benchmarks/gpu_step.py --json out.json  # also write the figures

fourd's rows time `fourd train` itself (a subprocess; the median of the step times it logs, after warm-up), with the
byte tokenizer under the 128,256-entry vocabulary (padding rows, as Megatron pads a vocabulary). Hugging Face's rows
run a plain loop in this process on the same shape, batch and optimizer (AdamW, fused on CUDA). MFU counts
ModelConfig.flops_per_token, 6·(N − input embedding) + 12·L·H·Q·T per token, against the device's peak.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fourd.config import fourd_home
from fourd.measure.peak import device_peak_flops
from fourd.model.config import ModelConfig

SHAPE = dict(layers=16, dim=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256)
TINY = dict(layers=2, dim=64, ffn=176, heads=4, kv_heads=2, vocab=512)
WARMUP = 3  # steps left out of the median: allocation, autotuning and compilation


def fourd_row(shape: dict, batch: int, seq: int, steps: int, compiled: bool) -> float:
    """Median seconds per step of `fourd train` at this shape."""
    with tempfile.TemporaryDirectory(prefix="gpu-step-") as d:
        cmd = [
            sys.executable,
            "-m",
            "fourd",
            "train",
            "--model",
            "llama3-8b",
            "--steps",
            str(steps),
            "--run-dir",
            d,
        ]
        cmd += [f"--model.{k}={v}" for k, v in shape.items()] + [f"--model.max_seq={seq}"]
        cmd += [
            f"--data.seq_len={seq}",
            f"--train.global_batch={batch}",
            f"--train.compile={str(compiled).lower()}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"fourd train failed:\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(Path(d) / "metrics.jsonl") if line.strip()]
    return statistics.median(r["step_time_s"] for r in rows[WARMUP:] or rows)


def hf_row(
    shape: dict, batch: int, seq: int, steps: int, compiled: bool, device: torch.device
) -> float:
    """Median seconds per step of LlamaForCausalLM (SDPA attention) in a plain training loop."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["dim"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=seq,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if compiled else model
    tokens = torch.randint(0, shape["vocab"], (batch, seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with amp:
            logits = forward(input_ids=x).logits
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del model, opt, forward
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[WARMUP:] or times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny shape on CPU, batch 2 x 64 (shows the script runs)",
    )
    ap.add_argument("--eager", action="store_true", help="leave out the compiled rows")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda" if cuda else "cpu")
    shape, batch, seq = (TINY, 2, 64) if a.tiny else (SHAPE, 8, 2048)
    model = ModelConfig(**shape, max_seq=seq)
    peak, source = device_peak_flops(device.type, fourd_home())
    modes = ("eager",) if a.eager else ("eager", "compiled")
    rows = {("fourd", m): fourd_row(shape, batch, seq, a.steps, m == "compiled") for m in modes}
    rows |= {("hf", m): hf_row(shape, batch, seq, a.steps, m == "compiled", device) for m in modes}
    tokens = batch * seq
    name = torch.cuda.get_device_name() if cuda else "CPU"
    precision = "BF16 autocast over FP32 weights" if cuda else "FP32"
    print(
        f"{datetime.date.today()}, torch {torch.__version__}, {name}; {model.params():,} parameters,"
    )
    print(f"batch {batch} x {seq}, {precision}; peak {peak / 1e12:.1f} TFLOP/s ({source})")
    print("\n| | s/step | tokens/s | MFU |\n|---|---|---|---|")
    labels = {"fourd": "`fourd train`", "hf": "Hugging Face `LlamaForCausalLM` (SDPA)"}
    for (who, mode), step in rows.items():
        mfu = model.flops_per_token(seq) * tokens / step / peak
        print(f"| {labels[who]}, {mode} | {step:.3f} | {tokens / step:,.0f} | {mfu:.1%} |")
    pairs = [(("fourd", m), ("hf", m)) for m in modes] + [
        (("fourd", "compiled"), ("fourd", "eager"))
    ] * (not a.eager)
    ratios = {
        f"{' '.join(top)} / {' '.join(under)}": rows[under] / rows[top] for top, under in pairs
    }
    print("\ntokens/s ratios: " + "; ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if a.json:
        out = {
            "date": str(datetime.date.today()),
            "torch": torch.__version__,
            "device": name,
            "batch": batch,
        }
        out |= {
            "seq": seq,
            "peak_flops": peak,
            "step_time_s": {" ".join(k): v for k, v in rows.items()},
        }
        out["tokens_per_s_ratios"] = ratios
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
