"""Generation speed with and without the KV cache, and conversion time, on random weights.

OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_generate.py [--model small] [--new 128]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from fourd.ckpt import store
from fourd.hf import convert
from fourd.hf.inference import generate
from fourd.model.config import get_preset
from fourd.model.llama import build_model


def recompute(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = get_preset(args.model)
    model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(
        0, cfg.vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    t0 = time.perf_counter()
    cached = generate(model, prompt, args.new, greedy=True)
    t1 = time.perf_counter()
    plain = recompute(model, prompt, args.new)
    t2 = time.perf_counter()
    print(f"{args.model}: prompt {args.prompt}, {args.new} new tokens, 1 thread")
    print(f"  KV cache:  {args.new / (t1 - t0):8.1f} tokens/s")
    print(f"  recompute: {args.new / (t2 - t1):8.1f} tokens/s   (same ids: {cached == plain})")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        store.save_model_checkpoint(Path(tmp) / "fd", cfg, model.state_dict())
        t1 = time.perf_counter()
        convert.fourd_to_hf(Path(tmp) / "fd", Path(tmp) / "hf")
        t2 = time.perf_counter()
        convert.hf_to_fourd(Path(tmp) / "hf", Path(tmp) / "fd2")
        t3 = time.perf_counter()
    print(
        f"  save {t1 - t0:.2f} s, export to HF {t2 - t1:.2f} s, import from HF {t3 - t2:.2f} s "
        f"({cfg.params() * 4 / 1e6:.1f} MB of float32)"
    )


if __name__ == "__main__":
    main()
