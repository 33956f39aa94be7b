"""Benchmark collectives as nccl-tests does (docs/comm.md): message sizes doubling from --min-bytes
to --max-bytes, each row the median over iterations of the slowest rank's time, algbw = size / time,
busbw = algbw × bus factor. `ring` is fourd's own ring all-reduce; `sendrecv`: every rank sends to
the next, receives from the previous.

examples:
  fourd bench comm --op all_reduce --nproc 4
  fourd bench comm --op ring --nproc 4 --json
  fourd bench comm --op all --nproc 2 --max-bytes 1M --iters 20
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time

from fourd.comm import bus_factor
from fourd.comm.launch import backend, run_workers
from fourd.errors import FourdError

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "ring",
    "sendrecv",
)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw ratio for a bench op (`ring` is an all-reduce)."""
    return bus_factor({"ring": "all_reduce", "sendrecv": "send"}.get(op, op), n)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text).upper())
    if not m or int(m.group(1)) <= 0:
        raise FourdError(
            f"bad size {text!r}: give a positive byte count such as 4096, 64K, 16M or 1G"
        )
    return int(m.group(1)) * _UNITS[m.group(2)]


def fmt_bytes(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def sweep_sizes(lo: int, hi: int) -> list[int]:
    return [lo << k for k in range((hi // lo).bit_length())]


def _prepare(op: str, nbytes: int, group, device):
    """The callable that runs `op` once on `nbytes`, and the number of float32 elements it moves."""
    import torch
    import torch.distributed as dist

    from fourd.comm.ring import ring_all_reduce

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    count = max(n, nbytes // 4 // n * n)
    # zeros: repeated sums stay finite and the arithmetic costs the same as for any normal values
    buf, part, out = (torch.zeros(k, device=device) for k in (count, count // n, count))
    shift = [
        dist.P2POp(dist.isend, buf, group=group, group_peer=(rank + 1) % n),
        dist.P2POp(dist.irecv, out, group=group, group_peer=(rank - 1) % n),
    ]
    ops = {
        "all_reduce": lambda: dist.all_reduce(buf, group=group),
        "ring": lambda: ring_all_reduce(buf, group=group),
        "broadcast": lambda: dist.broadcast(buf, group=group, group_src=0),
        "all_gather": lambda: dist.all_gather_single(buf, part, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, buf, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, buf, group=group),
        "sendrecv": lambda: [r.wait() for r in dist.batch_isend_irecv(shift)],
    }
    return ops[op], count


def time_op(op: str, nbytes: int, iters: int, warmup: int, group=None) -> dict:
    """One row: median over `iters` timed runs of the slowest rank in `group` (all its ranks call
    this)."""
    import torch
    import torch.distributed as dist

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn, count = _prepare(op, nbytes, group, device)
    for _ in range(warmup):
        fn()
    sync()
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        result = fn()  # the ring returns its RingStats
        sync()
        times[i] = time.perf_counter() - t0
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    n = dist.get_world_size(group)
    size = count * 4
    t = statistics.median(times.tolist())
    algbw = size / t / 1e9
    row = dict(
        op=op,
        nproc=n,
        bytes=size,
        time_s=t,
        algbw_gbps=algbw,
        busbw_gbps=algbw * busbw_factor(op, n),
    )
    row.update(iters=iters, backend=dist.get_backend(group))
    if op == "ring":
        row.update(steps=result.steps, bytes_sent_per_rank=result.bytes_sent)
    return row


def _sweep(rank: int, nproc: int, ops, sizes, iters, warmup) -> list[dict]:
    return [time_op(op, s, iters, warmup) for op in ops for s in sizes]


def add_arguments(p):
    ops = COLLECTIVES + ("all",)
    p.add_argument(
        "--op",
        default="all_reduce",
        choices=ops,
        help="collective to time (default all_reduce; all: each)",
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="ranks to launch (default: the GPUs, or 2 on CPU)"
    )
    p.add_argument("--min-bytes", default="1K", help="smallest message (default 1K)")
    p.add_argument(
        "--max-bytes", default=None, help="largest message (default 256M on GPUs, 64M on CPU)"
    )
    p.add_argument("--iters", type=int, default=10, help="timed iterations per size (default 10)")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed iterations per size first (default 2)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of rows")


def run(args) -> int:
    lo, (iters, warmup) = parse_bytes(args.min_bytes), (args.iters, args.warmup)
    if iters < 1 or warmup < 0:
        raise FourdError(
            f"--iters {iters} --warmup {warmup}: need at least 1 timed iteration "
            "and no negative warm-up"
        )
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    hi = parse_bytes(args.max_bytes or ("256M" if gpus else "64M"))
    if hi < lo:
        raise FourdError(
            f"--max-bytes {args.max_bytes} is below --min-bytes {args.min_bytes}: raise --max-bytes"
        )
    nproc = args.nproc if args.nproc is not None else (gpus or 2)
    most = gpus or 8 * (
        os.cpu_count() or 1
    )  # CPU ranks share the cores: beyond a few per core, only waiting
    if not 2 <= nproc <= most:
        raise FourdError(
            f"--nproc {nproc}: a collective needs 2 ranks or more, and this "
            f"machine runs at most {most}"
        )
    ops = list(COLLECTIVES) if args.op == "all" else [args.op]
    rows = run_workers(_sweep, nproc, (ops, sweep_sizes(lo, hi), iters, warmup))[0]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"# {backend()}, {nproc} ranks, float32, median of {iters} timed iterations "
        f"after {warmup} warm-up"
    )
    print(
        f"{'op':>14} {'size':>8} {'bytes':>11} {'time (us)':>11} "
        f"{'algbw GB/s':>11} {'busbw GB/s':>11}"
    )
    line = "{op:>14} {size:>8} {bytes:>11} {us:>11.1f} {algbw_gbps:>11.3f} {busbw_gbps:>11.3f}"
    print(
        "\n".join(line.format(**r, size=fmt_bytes(r["bytes"]), us=r["time_s"] * 1e6) for r in rows)
    )
    return 0
