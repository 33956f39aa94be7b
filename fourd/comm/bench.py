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


def busbw_factor(collective: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw ratio for a bench op (`ring` is an all-reduce)."""
    return bus_factor({"ring": "all_reduce", "sendrecv": "send"}.get(collective, collective), ranks)


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text).upper())
    if not match or int(match.group(1)) <= 0:
        raise FourdError(
            f"bad size {text!r}: give a positive byte count such as 4096, 64K, 16M or 1G"
        )
    return int(match.group(1)) * _UNITS[match.group(2)]


def fmt_bytes(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def sweep_sizes(smallest: int, largest: int) -> list[int]:
    return [smallest << k for k in range((largest // smallest).bit_length())]


def _prepare(collective: str, nbytes: int, group, device):
    """The callable that runs `op` once on `nbytes`, and the number of float32 elements it moves."""
    import torch
    import torch.distributed as dist

    from fourd.comm.ring import ring_all_reduce

    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    count = max(ranks, nbytes // 4 // ranks * ranks)
    # zeros: repeated sums stay finite and the arithmetic costs the same as for any normal values
    buf, part, out = (
        torch.zeros(elements, device=device) for elements in (count, count // ranks, count)
    )
    shift = [
        dist.P2POp(dist.isend, buf, group=group, group_peer=(rank + 1) % ranks),
        dist.P2POp(dist.irecv, out, group=group, group_peer=(rank - 1) % ranks),
    ]
    ops = {
        "all_reduce": lambda: dist.all_reduce(buf, group=group),
        "ring": lambda: ring_all_reduce(buf, group=group),
        "broadcast": lambda: dist.broadcast(buf, group=group, group_src=0),
        "all_gather": lambda: dist.all_gather_single(buf, part, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, buf, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, buf, group=group),
        "sendrecv": lambda: [request.wait() for request in dist.batch_isend_irecv(shift)],
    }
    return ops[collective], count


def time_op(collective: str, nbytes: int, iters: int, warmup: int, group=None) -> dict:
    """One row: median over `iters` timed runs of the slowest rank in `group` (all its ranks call
    this)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    sync = lambda: None  # CPU collectives return when done
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        sync = torch.cuda.synchronize
    work, count = _prepare(collective, nbytes, group, device)
    for _ in range(warmup):
        work()
    sync()
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier(group=group)
        began = time.perf_counter()
        result = work()  # the ring returns its RingStats
        sync()
        times[i] = time.perf_counter() - began
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    ranks = dist.get_world_size(group)
    size = count * 4
    median_s = statistics.median(times.tolist())
    algbw = size / median_s / 1e9
    row = dict(
        op=collective,
        nproc=ranks,
        bytes=size,
        time_s=median_s,
        algbw_gbps=algbw,
        busbw_gbps=algbw * busbw_factor(collective, ranks),
    )
    row.update(iters=iters, backend=dist.get_backend(group))
    if collective == "ring":
        row.update(steps=result.steps, bytes_sent_per_rank=result.bytes_sent)
    return row


def _sweep(rank: int, nproc: int, ops, sizes, iters, warmup) -> list[dict]:
    return [time_op(collective, size, iters, warmup) for collective in ops for size in sizes]


def add_arguments(parser):
    ops = COLLECTIVES + ("all",)
    parser.add_argument(
        "--op",
        default="all_reduce",
        choices=ops,
        help="collective to time (default all_reduce; all: each)",
    )
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks to launch (default: the GPUs, or 2 on CPU)"
    )
    parser.add_argument("--min-bytes", default="1K", help="smallest message (default 1K)")
    parser.add_argument(
        "--max-bytes", default=None, help="largest message (default 256M on GPUs, 64M on CPU)"
    )
    parser.add_argument(
        "--iters", type=int, default=10, help="timed iterations per size (default 10)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed iterations per size first (default 2)"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")


def run(args) -> int:
    smallest = parse_bytes(args.min_bytes)
    iters, warmup = args.iters, args.warmup
    if iters < 1 or warmup < 0:
        raise FourdError(
            f"--iters {iters} --warmup {warmup}: need at least 1 timed iteration "
            "and no negative warm-up"
        )
    import torch

    gpus = 0
    default_max = "64M"
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        default_max = "256M"
    largest = parse_bytes(args.max_bytes or default_max)
    if largest < smallest:
        raise FourdError(
            f"--max-bytes {args.max_bytes} is below --min-bytes {args.min_bytes}: raise --max-bytes"
        )
    nproc = args.nproc
    if nproc is None:
        nproc = gpus or 2
    # CPU ranks share the cores: beyond a few per core, only waiting
    most = gpus or 8 * (os.cpu_count() or 1)
    if not 2 <= nproc <= most:
        raise FourdError(
            f"--nproc {nproc}: a collective needs 2 ranks or more, and this "
            f"machine runs at most {most}"
        )
    ops = [args.op]
    if args.op == "all":
        ops = list(COLLECTIVES)
    rows = run_workers(_sweep, nproc, (ops, sweep_sizes(smallest, largest), iters, warmup))[0]
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
    for row in rows:
        print(line.format(**row, size=fmt_bytes(row["bytes"]), us=row["time_s"] * 1e6))
    return 0
