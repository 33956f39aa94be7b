"""Measure this machine and write its cluster profile, `local`, for `fourd plan --cluster local`.

What it measures, as one worker process of `fourd train` sees it (one OpenMP thread; a CPU
"device" is one worker process, and the machine is one node of 8 of them):
  - FP32 matmul throughput across square shapes: the efficiency curve, as [[gpu.gemm]] samples;
    peak_tflops is the best matmul throughput with all cores, as the trainer's MFU counts it: the
    better of a threaded matmul and one single-threaded worker process per core at once (or one
    thread's best, if that was higher because other work slowed both)
  - the GEMMs of training, as eager torch runs them: a linear layer's forward x·Wᵀ, input gradient
    dY·W and weight gradient dYᵀ·X for token counts and model dimensions around the presets'
    (one thread), as [[gpu.gemm_shapes]] samples
  - causal attention (torch's scaled_dot_product_attention, forward and backward, with is_causal and
    with an explicit mask as context parallelism uses) across sequence lengths and head sizes, as
    [[gpu.attention]] samples
  - the unfused elementwise ops of a layer (RMSNorm, RoPE, SiLU·mul, residual adds; forward and
    backward) and torch's AdamW (foreach=False, as the trainer runs it): rates in the bytes the
    planner counts for them (elementwise_gbps, optimizer_gbps)
  - memory bandwidth: a large tensor copy (read + write)
  - collectives: a fit time = alpha + beta · bytes (bytes as nccl-tests count them, see
    `fourd bench comm --help`) for all_reduce, all_gather and reduce_scatter over 2, 4 and 8
    ranks, and for point-to-point send/recv between 2 ranks (op "send")
The loopback figures of the send/recv fit also stand for the node's links and the network.

Default run: under a minute (about 30 s here); --quick: a coarser, smaller sweep in about 8 s
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

DEVICES = 8  # worker processes taken as one node
OPS = ("all_reduce", "all_gather", "reduce_scatter")
PLANS = {
    #            gemm sizes (square)                                              group sizes  message sizes       iters
    "full": (
        (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048),
        (2, 4, 8),
        (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24),
        10,
    ),
    "quick": ((16, 32, 64, 128, 256), (2, 4), (1 << 10, 1 << 14, 1 << 20, 1 << 22), 4),
}
SHAPES = {
    #         tokens per microbatch  model dims (in, out)  attention seq  head sizes
    "full": ((256, 1024, 4096), (64, 256, 1024), (64, 256, 1024), (16, 32, 64, 128)),
    "quick": ((256, 1024), (64, 256), (128, 256), (32,)),
}
CONCURRENT_N = 512  # matmul size timed on every core at once
SAMPLE_S = 0.03  # timed per training-shape sample (best of batches)
SMALL_MESSAGE = 1 << 14  # at most this: time is latency (alpha)
LARGE_MESSAGE = 1 << 18  # at least this: time is mostly bandwidth (beta)


def best_seconds(fn, seconds: float) -> float:
    """Best time of one call of `fn` over timed batches of about 2 ms each, for at least `seconds` (and
    at least 4 batches)."""
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, int(2e-3 / max(time.perf_counter() - t0, 1e-7)))
    best, start = float("inf"), time.perf_counter()
    for batch in range(1000):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
        if batch >= 3 and time.perf_counter() - start > seconds:
            break
    return best


def gemm_tflops(n: int, threads: int, seconds: float = 0.1) -> float:
    """Best throughput of an n×n×n FP32 matmul over timed batches of about 2 ms each."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        return 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=c), seconds) / 1e12
    finally:
        torch.set_num_threads(before)


def training_gemms(tokens, dims, seconds: float = SAMPLE_S) -> list[tuple[int, int, int, float]]:
    """(m, n, k, TFLOP/s) of one thread running a linear layer's three GEMMs as autograd does, for every
    token count and (in, out) pair of dims, (m, n, k) as the planner names them: forward x·Wᵀ
    (tokens, out, in), input gradient dY·W (tokens, in, out), weight gradient dYᵀ·X (in, out, tokens).
    Their rates differ from square matmuls' by the operands' orientation and the long reduction over
    tokens of the weight gradient."""
    import torch

    out = []
    for t in tokens:
        for d_in in dims:
            for d_out in dims:
                x, w, dy = torch.randn(t, d_in), torch.randn(d_out, d_in), torch.randn(t, d_out)
                flops = 2 * t * d_in * d_out / 1e12
                for shape, fn in (
                    ((t, d_out, d_in), lambda: torch.mm(x, w.t())),
                    ((t, d_in, d_out), lambda: torch.mm(dy, w)),
                    ((d_in, d_out, t), lambda: torch.mm(dy.t(), x)),
                ):
                    out.append((*shape, flops / best_seconds(fn, seconds)))
    return out


def attention_rates(seqs, head_dims, seconds: float = SAMPLE_S) -> list[tuple[int, int, float, float, float, float]]:
    """(seq, head_dim, forward and backward TFLOP/s with is_causal, the same with an explicit causal mask)
    of torch's scaled_dot_product_attention on one thread, in the planner's FLOPs: 4·pairs·head_dim per
    head forward, 2.5 times that backward; is_causal skips the masked half (seq²/2 pairs), an explicit
    mask (context parallelism's) computes all seq².
    Heads times batch make about 4M query-key pairs per call, the size of a training microbatch's."""
    import torch
    import torch.nn.functional as F

    out = []
    for seq in seqs:
        for hd in head_dims:
            heads = max(1, (1 << 22) // (seq * seq))
            # [batch, seq, heads, hd] transposed to [batch, heads, seq, hd], as the model hands them over
            q, k, v = (torch.randn(1, seq, heads, hd).transpose(1, 2).requires_grad_() for _ in range(3))
            grad = torch.randn(1, heads, seq, hd)
            mask = torch.ones(seq, seq, dtype=torch.bool).tril()

            def forward():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def both():
                forward().backward(grad)

            def masked():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

            def masked_both():
                masked().backward(grad)

            rates = []
            for fwd_fn, both_fn, pairs in ((forward, both, seq * seq / 2), (masked, masked_both, seq * seq)):
                flops = 4 * pairs * hd * heads / 1e12
                fwd = best_seconds(fwd_fn, seconds)
                bwd = max(best_seconds(both_fn, seconds) - fwd, 1e-9)
                rates += [flops / fwd, 2.5 * flops / bwd]
            out.append((seq, hd, *rates))
    return out


def elementwise_rate(tokens: int = 4096, seconds: float = 0.1) -> float:
    """GB/s, in the bytes fourd.plan.block counts for fourd's eager block, that one thread reaches running a
    `small` layer's memory-bound ops as the model does: two RMSNorms, RoPE on q and k, the GQA repeat of k
    and v, SiLU·mul and two residual adds, forward and backward."""
    import torch
    import torch.nn.functional as F

    from fourd.layout import Layout, Parallelism
    from fourd.model.config import get_preset
    from fourd.model.llama import RMSNorm, apply_rope, rope_table
    from fourd.plan.block import traffic
    from fourd.plan.cluster import load_cluster
    from fourd.plan.job import Job

    cfg, seq = get_preset("small"), 256
    cos, sin = rope_table(cfg.head_dim, torch.arange(seq), cfg.rope_theta)
    norms = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)

    def leaf(*shape):
        return torch.randn(tokens // seq, seq, *shape).requires_grad_()

    x, attn, ff, gate, up = leaf(cfg.dim), leaf(cfg.dim), leaf(cfg.dim), leaf(cfg.ffn), leaf(cfg.ffn)
    q, k, v = leaf(cfg.heads, cfg.head_dim), leaf(cfg.kv_heads, cfg.head_dim), leaf(cfg.kv_heads, cfg.head_dim)
    rep = cfg.heads // cfg.kv_heads

    def forward():
        h = x + attn
        kv = [t.transpose(1, 2).repeat_interleave(rep, dim=1) for t in (apply_rope(k, cos, sin), v)]
        return [norms[0](x), apply_rope(q, cos, sin), *kv, norms[1](h), F.silu(gate) * up, h + ff]

    grads = [torch.randn_like(t) for t in forward()]
    total = best_seconds(lambda: torch.autograd.backward(forward(), grads), seconds)
    work = Job(cfg, load_cluster("dgx-h100"), Parallelism(Layout()), seq, tokens // seq, "fp32").work
    t = traffic(work)
    return tokens * (t.forward + t.backward) / total / 1e9


def optimizer_rate(seconds: float = 0.1) -> float:
    """GB/s, in the bytes the planner counts for an Adam update (32 per FP32 parameter), of torch's AdamW
    stepping the `small` model's parameters one tensor at a time (foreach=False, as the trainer does)."""
    import torch

    from fourd.model.config import get_preset
    from fourd.model.llama import build_model
    from fourd.plan.kernels import ADAM_BYTES

    model = build_model(get_preset("small"), 0, "cpu")
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    n = sum(p.numel() for p in params)
    return n * ADAM_BYTES[4] / best_seconds(opt.step, seconds) / 1e9


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


def _workers(rank: int, nproc: int, cores: int, group_sizes, sizes, iters) -> dict:
    """One worker's share: the matmul rate it gets while one worker per core does the same (ranks below
    `cores`), then the collectives of its groups."""
    import torch.distributed as dist

    from fourd.comm.bench import time_op

    dist.barrier()
    concurrent = gemm_tflops(CONCURRENT_N, threads=1, seconds=0.3) if rank < cores else 0.0
    dist.barrier()
    rows = []
    groups = {g: dist.new_group(list(range(g))) for g in group_sizes}
    for g, group in groups.items():
        if rank < g:
            rows += [time_op(op, s, iters, 1, group) for op in OPS for s in sizes]
    if rank < 2:
        rows += [dict(time_op("sendrecv", s, iters, 1, groups[2]), op="send") for s in sizes]
    dist.barrier()
    return {"rows": rows, "concurrent_tflops": concurrent}


def measure(plan: str) -> dict:
    """Every figure of the profile, measured now."""
    from fourd.comm.launch import run_workers

    gemm_sizes, group_sizes, sizes, iters = PLANS[plan]
    cores = os.cpu_count() or 1
    gemm = [(n, gemm_tflops(n, threads=1)) for n in gemm_sizes]
    tokens, dims, seqs, head_dims = SHAPES[plan]
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shaped = training_gemms(tokens, dims)
        attention = attention_rates(seqs, head_dims)
        elementwise, optimizer = elementwise_rate(), optimizer_rate()
    finally:
        torch.set_num_threads(before)
    bandwidth = copy_gbps()
    workers = run_workers(_workers, max(group_sizes), (cores, group_sizes, sizes, iters), timeout_s=600)
    rows = workers[0]["rows"]
    concurrent = sum(w["concurrent_tflops"] for w in workers)
    # One worker process per core, as `fourd train` runs, keeps every core busy even when other work
    # delays one of them; a threaded matmul waits for its slowest thread at every call, so on a busy
    # machine it can fall below that sum, or below one thread's best. The peak is the best seen.
    threaded = [gemm_tflops(n, threads=cores, seconds=0.3) for n in (512, 1024, 2048)]
    peak = max(threaded + [concurrent] + [t for _, t in gemm])
    fits = {}
    for op in OPS + ("send",):
        for g in (2,) if op == "send" else group_sizes:
            alpha, beta = fit_alpha_beta([(r["bytes"], r["time_s"]) for r in rows if r["op"] == op and r["nproc"] == g])
            fits[(op, g)] = (alpha, beta)
    return {
        "cores": cores,
        "gemm": gemm,
        "peak_tflops": peak,
        "concurrent_tflops": concurrent,
        "copy_gbps": bandwidth,
        "fits": fits,
        "rows": rows,
        "gemm_shapes": shaped,
        "attention": attention,
        "elementwise_gbps": elementwise,
        "optimizer_gbps": optimizer,
    }


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
        f"elementwise_gbps = {m['elementwise_gbps']:.4g}   # a layer's eager norms, RoPE, SiLU·mul, adds (planner bytes)",
        f"optimizer_gbps = {m['optimizer_gbps']:.4g}   # AdamW foreach=False (planner bytes: 32 per parameter)",
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
    for gm, gn, gk, tflops in m["gemm_shapes"]:
        out += ["[[gpu.gemm_shapes]]", f"m = {gm}", f"n = {gn}", f"k = {gk}", f"tflops = {tflops:.6g}", ""]
    for seq, hd, fwd, bwd, masked_fwd, masked_bwd in m["attention"]:
        out += [
            "[[gpu.attention]]",
            f"seq = {seq}",
            f"head_dim = {hd}",
            f"fwd_tflops = {fwd:.6g}",
            f"bwd_tflops = {bwd:.6g}",
            f"masked_fwd_tflops = {masked_fwd:.6g}",
            f"masked_bwd_tflops = {masked_bwd:.6g}",
            "",
        ]
    for (op, g), (a, b) in m["fits"].items():
        out += [
            "[[collectives]]",
            f'op = "{op}"',
            f"nproc = {g}",
            f"alpha_s = {a:.6g}",
            f"beta_s_per_byte = {b:.6g}",
            "",
        ]
    return "\n".join(out)


def add_arguments(p):
    p.add_argument(
        "--out",
        default=None,
        help="where to write the profile (default $FOURD_HOME/clusters/local.toml, FOURD_HOME defaults to ~/.fourd)",
    )
    p.add_argument("--quick", action="store_true", help="a coarser, smaller sweep (about 8 s)")


def run(args) -> int:
    from fourd.config import fourd_home
    from fourd.plan.cluster import load_cluster

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
    print(
        f"  matmul FP32: {cluster.gpu.peak_tflops * 1e3:.1f} GFLOP/s on all {m['cores']} cores "
        f"({m['concurrent_tflops'] * 1e3:.1f} as one worker per core); one worker "
        f"{best[1] * 1e3:.1f} GFLOP/s at n={best[0]}, {m['gemm'][0][1] * 1e3:.2f} at n={m['gemm'][0][0]}"
    )
    rates = sorted(g.tflops for g in cluster.gpu.gemm_shapes)
    attn = [a.fwd_tflops for a in cluster.gpu.attention]
    print(
        f"  training-shape GEMMs: {rates[0] * 1e3:.1f} to {rates[-1] * 1e3:.1f} GFLOP/s (median "
        f"{statistics.median(rates) * 1e3:.1f}) over {len(rates)} shapes; attention forward "
        f"{min(attn) * 1e3:.1f} to {max(attn) * 1e3:.1f} GFLOP/s"
    )
    print(
        f"  eager elementwise ops {cluster.gpu.elementwise_gbps:.2f} GB/s, AdamW {cluster.gpu.optimizer_gbps:.2f} GB/s "
        "(planner-counted bytes)"
    )
    print(
        f"  memory copy: {cluster.gpu.hbm_bw_gbps:.2f} GB/s; send/recv {cluster.node.intra_bw_gbps:.3f} GB/s, "
        f"{cluster.node.intra_latency_us:.0f} us"
    )
    for s in cluster.collectives:
        print(
            f"  {s.op:>14} x{s.nproc}: alpha {s.alpha_s * 1e6:8.1f} us  1/beta {1 / s.beta_s_per_byte / 1e9:6.3f} GB/s"
        )
    return 0
