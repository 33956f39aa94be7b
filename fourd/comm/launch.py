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
    f"torch{suffix}"
    for suffix in (
        "",
        ".distributed.tensor.parallel",
        ".distributed.fsdp",
        ".distributed.pipelining",
    )
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend() -> str:
    import torch

    if torch.cuda.is_available():
        return "nccl"
    return "gloo"


def _worker(work, rank, world, port, timeout, args, results, backend_name):
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        torch.set_num_threads(1)
        if backend_name == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        wait = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=wait)
        dist.init_process_group(
            backend_name, store=store, rank=rank, world_size=world, timeout=wait
        )
        report = (rank, True, pickle.dumps(work(rank, world, *args)))
    except BaseException:
        # Stamped before the process group goes down, which is what makes the other ranks fail.
        report = (rank, time.time(), traceback.format_exc())
    if dist.is_initialized():
        dist.destroy_process_group()
    results.put(report)


def _collect(results, procs, timeout: float) -> dict[int, object]:
    world = len(procs)
    got: dict[int, object] = {}  # rank -> what it returned
    failed: dict[int, tuple] = {}  # rank -> (when it failed, its traceback)
    deadline = time.monotonic() + timeout
    while len(got) + len(failed) < world:
        try:
            rank, outcome, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                dead_rank
                for dead_rank, proc in enumerate(procs)
                if dead_rank not in got and dead_rank not in failed and proc.exitcode
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
        if outcome is True:
            got[rank] = pickle.loads(payload)
            continue
        if not failed:  # the others soon fail in their collectives: a moment, then blame the first
            deadline = min(deadline, time.monotonic() + 1.0)
        failed[rank] = (outcome, payload)
    if failed:
        first = min(failed, key=lambda dead_rank: failed[dead_rank][0])
        also = ""
        if len(failed) > 1:
            also = f" (then ranks {sorted(set(failed) - {first})} failed too)"
        raise RuntimeError(f"rank {first} failed{also}:\n{failed[first][1]}")
    return got


def run_workers(work, nproc: int, args: tuple = (), timeout_s: float = 300.0) -> list:
    """fn(rank, nproc, *args) on nproc fresh processes; their return values in rank order."""
    import torch.distributed as dist

    backend_name = backend()
    if backend_name == "nccl":
        ctx: Any = mp.get_context("spawn")  # CUDA cannot be forked into
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(work, rank, nproc, store.port, timeout_s, args, results, backend_name),
            daemon=True,
        )
        for rank in range(nproc)
    ]
    for proc in procs:
        proc.start()
    got: dict = {}
    try:
        got = _collect(results, procs, timeout_s)
    finally:
        # all returned: a moment for each to exit; otherwise kill them now
        grace_s = 0
        if len(got) == nproc:
            grace_s = 5
        for proc in procs:
            proc.join(timeout=grace_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [got[rank] for rank in range(nproc)]
