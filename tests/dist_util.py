"""Run a function on `world` real gloo ranks, one process each, and collect what every rank returns.

    results = run_ranks(fn, 4, arg1, arg2, timeout=120)   # fn(rank, world, arg1, arg2) on ranks 0..3

`fn` must be importable by name (a module-level function of a test module or of fourd). Its return value
comes back pickled, so return plain Python objects or CPU tensors. When a rank raises, dies or does not
finish within `timeout` seconds, every rank is killed and the test fails with that rank's traceback.

Processes come from a forkserver that has already imported torch, so a launch costs a fork, not an
import; each rank runs with OMP_NUM_THREADS=1 because the test machine has few cores. The parent
process owns the rendezvous store on a port the OS picks, so concurrent test runs never collide.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback

import torch.distributed as dist

_CTX = None
# Imported once by the forkserver, so that each rank starts with them already loaded.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
]


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _worker(fn, rank, world, port, timeout, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
        )
        out = fn(rank, world, *args)
        report = (rank, True, pickle.dumps(out))
    except BaseException:
        # Stamped before the process group goes down, which is what makes the other ranks fail.
        report = (rank, time.time(), traceback.format_exc())
    if dist.is_initialized():
        dist.destroy_process_group()
    results.put(report)


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    """fn(rank, world, *args) on `world` gloo ranks; returns the list of their return values, by rank."""
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, store.port, timeout, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    failed: dict[int, tuple[float, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) + len(failed) < world:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and r not in failed and p.exitcode]
                if dead and not failed:
                    raise AssertionError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    if failed:
                        break
                    missing = sorted(set(range(world)) - got.keys())
                    raise AssertionError(f"ranks {missing} did not finish within {timeout} s") from None
                continue
            if ok is True:
                got[rank] = pickle.loads(payload)
                continue
            if not failed:
                # The other ranks soon fail in their collectives; give them a moment, then blame the rank
                # that failed first.
                deadline = min(deadline, time.monotonic() + 1.0)
            failed[rank] = (ok, payload)
        if failed:
            first = min(failed, key=lambda r: failed[r][0])
            others = sorted(set(failed) - {first})
            also = f" (then ranks {others} failed too)" if others else ""
            raise AssertionError(f"rank {first} failed{also}:\n{failed[first][1]}")
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]
