"""Timing on a device: the best time of a call, a square matmul's throughput (`fourd calibrate` and
the trainer's peak FLOP/s both use these)."""

from __future__ import annotations

import time


def torch_for(device: str):
    """torch, the compute dtype of `device` and a function that waits for it."""
    import torch

    if device == "cuda":
        return torch, torch.bfloat16, torch.cuda.synchronize
    return torch, torch.float32, lambda: None


def best_seconds(work, seconds: float, device: str = "cpu") -> float:
    """Best time of one call of `work` over timed batches of about 2 ms, for at least `seconds` and
    4 batches."""
    _, _, sync = torch_for(device)
    for _ in range(2):  # a warm-up call, then one timed
        began = time.perf_counter()
        work()
        sync()
    # calls per batch: about 2 ms of them, judged by the timed call
    reps = max(1, int(2e-3 / max(time.perf_counter() - began, 1e-7)))
    best = float("inf")
    start = time.perf_counter()
    for batch in range(1000):
        began = time.perf_counter()
        for _ in range(reps):
            work()
        sync()
        best = min(best, (time.perf_counter() - began) / reps)
        if batch >= 3 and time.perf_counter() - start > seconds:
            break
    return best


def gemm_tflops(size: int, threads: int = 1, seconds: float = 0.1, device: str = "cpu") -> float:
    """Best throughput of a size×size×size matmul in the device's compute dtype, in TFLOP/s:
    2·size³ FLOPs per matmul."""
    torch, dtype, _ = torch_for(device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        left, right, product = (
            torch.randn(size, size, dtype=dtype, device=device) for _ in range(3)
        )
        return (
            2
            * size**3
            / best_seconds(lambda: torch.mm(left, right, out=product), seconds, device)
            / 1e12
        )
    finally:
        torch.set_num_threads(before)
