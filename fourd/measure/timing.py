"""Timing on a device: the best time of a call, a square matmul's throughput (`fourd calibrate` and
the trainer's peak FLOP/s both use these)."""

from __future__ import annotations

import time


def torch_for(device: str):
    """torch, the compute dtype of `device` and a function that waits for it."""
    import torch

    cuda = device == "cuda"
    return (
        torch,
        torch.bfloat16 if cuda else torch.float32,
        torch.cuda.synchronize if cuda else (lambda: None),
    )


def best_seconds(fn, seconds: float, device: str = "cpu") -> float:
    """Best time of one call of `fn` over timed batches of about 2 ms, for at least `seconds` and 4
    batches."""
    _, _, sync = torch_for(device)
    for _ in range(2):  # a warm-up call, then one timed
        t0 = time.perf_counter()
        fn()
        sync()
    reps, best, start = (
        max(1, int(2e-3 / max(time.perf_counter() - t0, 1e-7))),
        float("inf"),
        time.perf_counter(),
    )
    for batch in range(1000):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
        if batch >= 3 and time.perf_counter() - start > seconds:
            break
    return best


def gemm_tflops(n: int, threads: int = 1, seconds: float = 0.1, device: str = "cpu") -> float:
    """Best throughput of an n×n×n matmul in the device's compute dtype."""
    torch, dtype, _ = torch_for(device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b, c = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(3))
        return 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=c), seconds, device) / 1e12
    finally:
        torch.set_num_threads(before)
