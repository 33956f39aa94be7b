"""Measure this machine and write its cluster profile, `local`, for `fourd plan --cluster local`.

What it measures, as one worker process of `fourd train` sees it (one OpenMP thread; a CPU
"device" is one worker process, and the machine is one node of 8 of them):
  - FP32 matmul throughput across square shapes: the efficiency curve, as [[gpu.gemm]] samples;
    peak_tflops is the best matmul throughput with all cores, as the trainer's MFU counts it
    (or one thread's best, if that was higher because other work slowed the threaded run)
  - memory bandwidth: a large tensor copy (read + write)
  - collectives: a fit time = alpha + beta · bytes (bytes as nccl-tests count them, see
    `fourd bench comm --help`) for all_reduce, all_gather and reduce_scatter over 2, 4 and 8
    ranks, and for point-to-point send/recv between 2 ranks (op "send")
The loopback figures of the send/recv fit also stand for the node's links and the network.

Default run: under a minute (15 to 30 s here); --quick: a coarser, smaller sweep in about 10 s
(tests use it).

examples:
  fourd calibrate
  fourd calibrate --quick --out /tmp/local.toml
  fourd plan --model small --cluster local --layout tp=2,dp=2 --seq 256 --global-batch-tokens 8192
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from pathlib import Path

from fourd.errors import FourdError

DEVICES = 8           # worker processes taken as one node
OPS = ("all_reduce", "all_gather", "reduce_scatter")
PLANS = {
    #            gemm sizes (square)                                              group sizes  message sizes       iters
    "full": ((16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048), (2, 4, 8), (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24), 10),
    "quick": ((16, 32, 64, 128, 256), (2, 4), (1 << 10, 1 << 14, 1 << 20, 1 << 22), 4),
}
SMALL_MESSAGE = 1 << 14   # at most this: time is latency (alpha)
LARGE_MESSAGE = 1 << 18   # at least this: time is mostly bandwidth (beta)


def gemm_tflops(n: int, threads: int, seconds: float = 0.1) -> float:
    """Best throughput of an n×n×n FP32 matmul over timed batches of about 2 ms each."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        torch.mm(a, b, out=c)
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        reps = max(1, int(2e-3 / max(time.perf_counter() - t0, 1e-7)))
        best, start = float("inf"), time.perf_counter()
        for batch in range(1000):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=c)
            best = min(best, (time.perf_counter() - t0) / reps)
            if batch >= 3 and time.perf_counter() - start > seconds:
                break
        return 2 * n**3 / best / 1e12
    finally:
        torch.set_num_threads(before)


def copy_gbps(nbytes: int = 64 << 20, repeats: int = 20) -> float:
    """Memory bandwidth of one thread copying a large tensor: bytes read plus bytes written, per second."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return 2 * nbytes / best / 1e9
    finally:
        torch.set_num_threads(before)


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(alpha s, beta s/byte) of t = alpha + beta·bytes: alpha the median time of small messages,
    beta the least-squares slope of the rest of the time over the large ones.

    When other work on the machine inflates the small-message times past what the large messages
    leave, beta falls back to the largest message's time per byte, an upper bound."""
    alpha = statistics.median(t for s, t in points if s <= SMALL_MESSAGE)
    large = [(s, t - alpha) for s, t in points if s >= LARGE_MESSAGE]
    beta = sum(s * t for s, t in large) / sum(s * s for s, _ in large)
    if beta <= 0:
        s, t = max(points)
        beta = t / s
    return alpha, beta


def _collectives(rank: int, nproc: int, group_sizes, sizes, iters) -> list[dict]:
    import torch.distributed as dist

    from fourd.comm.bench import time_op

    rows = []
    groups = {g: dist.new_group(list(range(g))) for g in group_sizes}
    for g, group in groups.items():
        if rank < g:
            rows += [time_op(op, s, iters, 1, group) for op in OPS for s in sizes]
    if rank < 2:
        rows += [dict(time_op("sendrecv", s, iters, 1, groups[2]), op="send") for s in sizes]
    dist.barrier()
    return rows


def measure(plan: str) -> dict:
    """Every figure of the profile, measured now."""
    from fourd.comm.launch import run_workers

    gemm_sizes, group_sizes, sizes, iters = PLANS[plan]
    cores = os.cpu_count() or 1
    gemm = [(n, gemm_tflops(n, threads=1)) for n in gemm_sizes]
    # a busy machine can slow the threaded run below one thread's best; the peak is the best seen
    peak = max([gemm_tflops(n, threads=cores, seconds=0.3) for n in (512, 1024, 2048)] + [t for _, t in gemm])
    bandwidth = copy_gbps()
    rows = run_workers(_collectives, max(group_sizes), (group_sizes, sizes, iters), timeout_s=600)[0]
    fits = {}
    for op in OPS + ("send",):
        for g in (2,) if op == "send" else group_sizes:
            alpha, beta = fit_alpha_beta([(r["bytes"], r["time_s"]) for r in rows if r["op"] == op and r["nproc"] == g])
            fits[(op, g)] = (alpha, beta)
    return {"cores": cores, "gemm": gemm, "peak_tflops": peak, "copy_gbps": bandwidth, "fits": fits, "rows": rows}


def _memory_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    raise FourdError("no MemTotal in /proc/meminfo: calibrate needs Linux")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_toml(m: dict, command: str) -> str:
    """The `local` cluster profile in the planner's schema (fourd.plan.cluster)."""
    alpha, beta = m["fits"][("send", 2)]
    link_gbps, link_us = 1 / beta / 1e9, alpha * 1e6
    today = datetime.date.today().isoformat()
    out = [
        '# Written by `fourd calibrate`; rerun it to refresh. One "GPU" is one worker process',
        "# (one OpenMP thread); the node is this machine.",
        'name = "local"',
        f'description = "this machine ({m["cores"]} CPU cores), measured on {today}; one device = one worker process"',
        'dtype = "fp32"',
        "",
        "[gpu]",
        f'name = "{_cpu_name()}, one worker process"',
        f"peak_tflops = {m['peak_tflops']:.6g}   # best FP32 matmul with all {m['cores']} cores",
        f"memory_gb = {_memory_gb() / DEVICES:.4g}   # this machine's memory shared by {DEVICES} workers",
        f"hbm_bw_gbps = {m['copy_gbps']:.4g}   # one thread copying 64 MB",
        "",
        "[node]",
        f"gpus = {DEVICES}",
        f"intra_bw_gbps = {link_gbps:.4g}   # loopback send/recv between two workers",
        f"intra_latency_us = {link_us:.4g}",
        f"concurrent_ranks = {m['cores']}   # workers beyond this share cores",
        "",
        "[network]",
        f"nic_bw_gbps = {link_gbps:.4g}   # no network: the loopback figures",
        f"latency_us = {link_us:.4g}",
        f"gpus_per_rack = {DEVICES}",
        f"gpus_per_pod = {DEVICES}",
        "pods = 1",
        "",
        "[calibration]",
        f'date = "{today}"',
        f'command = "{command}"',
        f"cores = {m['cores']}",
        "threads_per_worker = 1",
        "",
    ]
    for n, tflops in m["gemm"]:
        out += ["[[gpu.gemm]]", f"m = {n}", f"n = {n}", f"k = {n}", f"tflops = {tflops:.6g}", ""]
    for (op, g), (a, b) in m["fits"].items():
        out += ["[[collectives]]", f'op = "{op}"', f"nproc = {g}", f"alpha_s = {a:.6g}", f"beta_s_per_byte = {b:.6g}", ""]
    return "\n".join(out)


def add_arguments(p):
    p.add_argument("--out", default=None,
                   help="where to write the profile (default $FOURD_HOME/clusters/local.toml, FOURD_HOME defaults to ~/.fourd)")
    p.add_argument("--quick", action="store_true", help="a coarser, smaller sweep (about 10 s)")


def run(args) -> int:
    from fourd.plan.cluster import fourd_home, load_cluster

    out = Path(args.out) if args.out else fourd_home() / "clusters" / "local.toml"
    if out.suffix != ".toml":
        raise FourdError(f"--out {args.out}: the planner reads .toml profiles; end the path in .toml")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FourdError(f"--out {out}: cannot create {out.parent} ({e.strerror}); choose a writable path") from None
    m = measure("quick" if args.quick else "full")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(profile_toml(m, "fourd calibrate" + (" --quick" if args.quick else "")))
    os.replace(tmp, out)
    cluster = load_cluster(str(out))
    best = max(m["gemm"], key=lambda x: x[1])
    print(f"wrote {out}")
    print(f"  matmul FP32: {cluster.gpu.peak_tflops * 1e3:.1f} GFLOP/s on all {m['cores']} cores; one worker "
          f"{best[1] * 1e3:.1f} GFLOP/s at n={best[0]}, {m['gemm'][0][1] * 1e3:.2f} at n={m['gemm'][0][0]}")
    print(f"  memory copy: {cluster.gpu.hbm_bw_gbps:.2f} GB/s; send/recv {cluster.node.intra_bw_gbps:.3f} GB/s, "
          f"{cluster.node.intra_latency_us:.0f} us")
    for s in cluster.collectives:
        print(f"  {s.op:>14} x{s.nproc}: alpha {s.alpha_s * 1e6:8.1f} us  1/beta {1 / s.beta_s_per_byte / 1e9:6.3f} GB/s")
    return 0
