"""Start N local worker processes joined in one process group, run a function on each, collect what
each returns. Used by the comm benchmark, calibration and the comm tests.

gloo on CPU, NCCL when CUDA is available (one GPU per rank). Workers run with one OpenMP thread
each, since several share a few cores; every wait is bounded.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _worker(rank: int, nproc: int, port: int, out_dir: str, fn, args, timeout_s: float):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    be = backend()
    if be == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        be, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc, timeout=timedelta(seconds=timeout_s)
    )
    try:
        result = fn(rank, nproc, *args)
        with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_workers(fn, nproc: int, args: tuple = (), timeout_s: float = 300.0) -> list:
    """Run `fn(rank, nproc, *args)` on `nproc` fresh processes; return the results in rank order.

    `fn` must be importable by name (a module-level function), since GPU workers are spawned.
    """
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    # Forked workers start in milliseconds where spawned ones each import torch again (seconds of a
    # shared core); CUDA cannot be forked into, so GPU workers are spawned.
    method = "spawn" if backend() == "nccl" else "fork"
    with tempfile.TemporaryDirectory(prefix="fourd-comm-") as out:
        ctx = mp.start_processes(
            _worker, args=(nproc, free_port(), out, fn, args, timeout_s), nprocs=nproc, join=False, start_method=method
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{nproc} comm workers did not finish within {timeout_s:.0f} s")
        results = []
        for rank in range(nproc):
            with open(Path(out) / f"{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
