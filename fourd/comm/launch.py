"""Run a module-level fn(rank, nproc, *args) on nproc fresh local processes joined in one process
group and collect what each returns: the launcher of the comm benchmark, calibration and the
multi-rank tests (training has its own, elastic one). gloo ranks fork from a forkserver that has
imported torch; NCCL ranks are spawned. When a rank raises, dies or outlasts the timeout, every rank
is killed and RuntimeError carries its traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any

_PRELOAD = [
    f"torch{m}"
    for m in ("", ".distributed.tensor.parallel", ".distributed.fsdp", ".distributed.pipelining")
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _worker(fn, rank, world, port, timeout, args, results, be):
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        torch.set_num_threads(1)
        if be == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        wait = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=wait)
        dist.init_process_group(be, store=store, rank=rank, world_size=world, timeout=wait)
        report = (rank, True, pickle.dumps(fn(rank, world, *args)))
    except BaseException:
        # Stamped before the process group goes down, which is what makes the other ranks fail.
        report = (rank, time.time(), traceback.format_exc())
    if dist.is_initialized():
        dist.destroy_process_group()
    results.put(report)


def _collect(results, procs, timeout: float) -> dict[int, object]:
    world, got, failed = len(procs), dict[int, object](), dict[int, tuple]()
    deadline = time.monotonic() + timeout
    while len(got) + len(failed) < world:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                r for r, p in enumerate(procs) if r not in got and r not in failed and p.exitcode
            ]
            if dead and not failed:
                raise RuntimeError(
                    f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                ) from None
            if time.monotonic() > deadline:
                if failed:
                    break
                missing = sorted(set(range(world)) - got.keys())
                raise RuntimeError(f"ranks {missing} did not finish within {timeout:g} s") from None
            continue
        if ok is True:
            got[rank] = pickle.loads(payload)
            continue
        if not failed:  # the others soon fail in their collectives: a moment, then blame the first
            deadline = min(deadline, time.monotonic() + 1.0)
        failed[rank] = (ok, payload)
    if failed:
        first = min(failed, key=lambda r: failed[r][0])
        also = (
            f" (then ranks {sorted(set(failed) - {first})} failed too)" if len(failed) > 1 else ""
        )
        raise RuntimeError(f"rank {first} failed{also}:\n{failed[first][1]}")
    return got


def run_workers(fn, nproc: int, args: tuple = (), timeout_s: float = 300.0) -> list:
    """fn(rank, nproc, *args) on nproc fresh processes; their return values in rank order."""
    import torch.distributed as dist

    be = backend()
    ctx: Any = mp.get_context(
        "spawn" if be == "nccl" else "forkserver"
    )  # CUDA cannot be forked into
    if be == "gloo":
        ctx.set_forkserver_preload(_PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, nproc, store.port, timeout_s, args, results, be),
            daemon=True,
        )
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    got: dict = {}
    try:
        got = _collect(results, procs, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == nproc else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(nproc)]
