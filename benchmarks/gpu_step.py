"""One training step of a 1B-class Llama on CUDA in BF16 autocast: tokens/s and MFU.

    python benchmarks/gpu_step.py                 # on a GPU: Llama-3.2-1B-like shape, batch 8 x 2048
    python benchmarks/gpu_step.py --tiny          # anywhere (CPU): the debug model, to show it runs

MFU = (6N + 12·L·H·Q·T) FLOPs per token × tokens/s ÷ the device's peak (datasheet dense BF16 on
known GPUs, the measured matmul peak on CPU), the same definition `fourd train` logs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fourd.config import fourd_home
from fourd.model.config import PRESETS, ModelConfig
from fourd.model.llama import build_model
from fourd.parallel.apply import cross_entropy
from fourd.train.metrics import device_peak_flops

ONE_B = ModelConfig(layers=16, dim=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256, max_seq=8192)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the debug preset (runs on CPU in seconds)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = PRESETS["debug"] if a.tiny else ONE_B
    seq = min(a.seq, cfg.max_seq)
    model = build_model(cfg, seed=0, device=device)
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x = torch.randint(0, cfg.vocab, (a.batch, seq + 1), device=device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    times = []
    for _ in range(a.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with amp:
            loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = sorted(times[2:] or times)[len(times[2:] or times) // 2]
    tokens_per_s = a.batch * seq / step
    peak, source = device_peak_flops(device.type, fourd_home())
    mfu = cfg.flops_per_token(seq) * tokens_per_s / peak
    out = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "params": cfg.params(),
        "batch": a.batch,
        "seq": seq,
        "step_time_s": step,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_source": source,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "loss": loss.item(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
