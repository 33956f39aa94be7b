"""Measure this machine and write its cluster profile, `local` (`fourd plan --cluster local`): on a CUDA device
one GPU in BF16, on CPUs one worker process of `fourd train` in FP32 (what is measured: docs/planner.md).
Under a minute on CPUs; --quick: a coarser sweep in seconds.

examples:
  fourd calibrate
  fourd calibrate --quick --out /tmp/local.toml
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections import namedtuple
from pathlib import Path

from fourd.errors import FourdError
from fourd.measure.timing import best_seconds, gemm_tflops, torch_for

CPU_DEVICES = 8  # CPU worker processes taken as one node
OPS = ("all_reduce", "all_gather", "reduce_scatter")
SMALL_MESSAGE, LARGE_MESSAGE = (
    1 << 14,
    1 << 18,
)  # at most: latency (alpha); at least: mostly bandwidth (beta)


# square matmul sizes, collective group sizes and message bytes, iterations, training-shape GEMMs' tokens and
# widths (in, out), attention's sequence lengths and head sizes
Sweep = namedtuple("Sweep", "squares groups messages iters tokens dims seqs head_dims")

PLANS = {
    "full": Sweep(
        (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048),
        (2, 4, 8),
        tuple(1 << e for e in range(10, 26, 2)),
        10,
        (256, 1024, 4096),
        (64, 256, 1024),
        (64, 256, 1024),
        (16, 32, 64, 128),
    ),
    "quick": Sweep(
        (16, 32, 64, 128, 256),
        (2, 4),
        (1 << 10, 1 << 14, 1 << 20, 1 << 22),
        4,
        (256, 1024),
        (64, 256),
        (128, 256),
        (32,),
    ),
}
GPU_SCALE = 8  # on a GPU the training shapes are this many times larger (tokens and widths)
SAMPLE_S = 0.03  # timed per training-shape sample (best of batches)


def training_gemms(tokens, dims, device: str = "cpu", seconds: float = SAMPLE_S) -> list[tuple]:
    """(m, n, k, TFLOP/s) of a linear layer's three GEMMs as autograd runs them for every token count and (in,
    out): forward (tokens, out, in), input gradient (tokens, in, out), weight gradient (in, out, tokens)."""
    torch, dtype, _ = torch_for(device)
    out = []
    for t in tokens:
        for d_in in dims:
            for d_out in dims:
                x, w, dy = (
                    torch.randn(*s, dtype=dtype, device=device)
                    for s in ((t, d_in), (d_out, d_in), (t, d_out))
                )
                flops = 2 * t * d_in * d_out / 1e12
                for shape, fn in (
                    ((t, d_out, d_in), lambda: x @ w.t()),
                    ((t, d_in, d_out), lambda: dy @ w),
                    ((d_in, d_out, t), lambda: dy.t() @ x),
                ):
                    out.append((*shape, flops / best_seconds(fn, seconds, device)))
    return out


def attention_rates(seqs, head_dims, device: str = "cpu", seconds: float = SAMPLE_S) -> list[tuple]:
    """(seq, head_dim, forward and backward TFLOP/s with is_causal, the same with an explicit causal mask) of
    torch's SDPA in the planner's FLOPs (is_causal: seq²/2 pairs; an explicit mask computes all seq²)."""
    torch, dtype, _ = torch_for(device)
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out = []
    for seq in seqs:
        for hd in head_dims:
            heads = max(
                1, (1 << 22) // (seq * seq)
            )  # about 4M query-key pairs per call, a microbatch's
            q, k, v = (
                torch.randn(1, seq, heads, hd, dtype=dtype, device=device)
                .transpose(1, 2)
                .requires_grad_()
                for _ in range(3)
            )
            grad, mask = (
                torch.randn_like(q),
                torch.ones(seq, seq, dtype=torch.bool, device=device).tril(),
            )
            rates = []
            for kw, pairs in (
                ({"is_causal": True}, seq * seq / 2),
                ({"attn_mask": mask}, seq * seq),
            ):
                flops = 4 * pairs * hd * heads / 1e12
                fwd = best_seconds(lambda kw=kw: sdpa(q, k, v, **kw), seconds, device)
                both = best_seconds(
                    lambda kw=kw: sdpa(q, k, v, **kw).backward(grad), seconds, device
                )
                rates += [flops / fwd, 2.5 * flops / max(both - fwd, 1e-9)]
            out.append((seq, hd, *rates))
    return out


def elementwise_rate(device: str = "cpu", tokens: int = 4096, seconds: float = 0.1) -> float:
    """GB/s, in fourd.plan.block's counted bytes, of a `small` layer's memory-bound ops run as the model does:
    two RMSNorms, RoPE on q and k, the GQA repeat of k and v, SiLU·mul, two residual adds, forward and backward."""
    torch, dtype, _ = torch_for(device)
    import torch.nn.functional as F

    from fourd.layout import Layout, Parallelism
    from fourd.model.config import get_preset
    from fourd.model.llama import RMSNorm, apply_rope, rope_table
    from fourd.plan.block import traffic
    from fourd.plan.cluster import load_cluster
    from fourd.plan.job import Job

    cfg, seq = get_preset("small"), 256
    tokens *= GPU_SCALE if device == "cuda" else 1
    cos, sin = (t.to(device) for t in rope_table(cfg.head_dim, torch.arange(seq), cfg.rope_theta))
    norms = [RMSNorm(cfg.dim, cfg.norm_eps).to(device) for _ in range(2)]

    def leaf(*shape):
        return torch.randn(tokens // seq, seq, *shape, dtype=dtype, device=device).requires_grad_()

    x, attn, ff, gate, up = (
        leaf(cfg.dim),
        leaf(cfg.dim),
        leaf(cfg.dim),
        leaf(cfg.ffn),
        leaf(cfg.ffn),
    )
    q, k, v = (
        leaf(cfg.heads, cfg.head_dim),
        leaf(cfg.kv_heads, cfg.head_dim),
        leaf(cfg.kv_heads, cfg.head_dim),
    )

    def forward():
        h, rep = x + attn, cfg.heads // cfg.kv_heads
        kv = [t.transpose(1, 2).repeat_interleave(rep, dim=1) for t in (apply_rope(k, cos, sin), v)]
        return [norms[0](x), apply_rope(q, cos, sin), *kv, norms[1](h), F.silu(gate) * up, h + ff]

    grads = [torch.randn_like(t) for t in forward()]
    total = best_seconds(lambda: torch.autograd.backward(forward(), grads), seconds, device)
    precision = "bf16" if device == "cuda" else "fp32"
    job = Job(
        model=cfg,
        cluster=load_cluster("dgx-h100"),
        par=Parallelism(Layout(dp=2)),
        seq=seq,
        global_seqs=2,
        precision=precision,
    )
    t = traffic(job.work)
    return tokens * (t.forward + t.backward) / total / 1e9


def optimizer_rate(device: str = "cpu", seconds: float = 0.1) -> float:
    """GB/s, in the planner's 32 bytes per FP32 parameter, of torch's AdamW on the `small` model: one tensor at a
    time on CPUs (foreach=False, as the trainer), fused on CUDA (as benchmarks/gpu_step.py)."""
    torch, _, _ = torch_for(device)
    from fourd.model.config import get_preset
    from fourd.model.llama import build_model
    from fourd.plan.kernels import ADAM_BYTES

    params = list(build_model(get_preset("small"), 0, device).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False, fused=device == "cuda")
    return (
        sum(p.numel() for p in params)
        * ADAM_BYTES[4]
        / best_seconds(opt.step, seconds, device)
        / 1e9
    )


def copy_gbps(device: str = "cpu", nbytes: int = 64 << 20) -> float:
    """Memory bandwidth of one thread copying a large tensor: bytes read plus bytes written, per second."""
    torch, _, _ = torch_for(device)
    src, dst = torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), 0.05, device) / 1e9


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(alpha s, beta s/byte) of t = alpha + beta·bytes: alpha the median of small messages, beta the slope over
    the large ones (or, when other work inflates the small ones, the largest message's time per byte)."""
    alpha = statistics.median(t for s, t in points if s <= SMALL_MESSAGE)
    large = [(s, t - alpha) for s, t in points if s >= LARGE_MESSAGE]
    beta = sum(s * t for s, t in large) / sum(s * s for s, _ in large)
    return alpha, beta if beta > 0 else max(points)[1] / max(points)[0]


def _workers(rank: int, nproc: int, cores: int, sweep: Sweep) -> dict:
    """One worker's share: on CPUs the matmul rate while one worker per core does the same, then collectives."""
    import torch.distributed as dist

    from fourd.comm.bench import time_op

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dist.barrier()
    concurrent = gemm_tflops(512, seconds=0.3) if rank < cores and device == "cpu" else 0.0
    dist.barrier()
    rows, groups = [], {g: dist.new_group(list(range(g))) for g in sweep.groups if g <= nproc}
    for g, group in groups.items():
        if rank < g:
            rows += [time_op(op, s, sweep.iters, 1, group) for op in OPS for s in sweep.messages]
    if rank < 2:
        rows += [
            dict(time_op("sendrecv", s, sweep.iters, 1, groups[2]), op="send")
            for s in sweep.messages
        ]
    dist.barrier()
    return {"rows": rows, "concurrent_tflops": concurrent}


def _layer_overheads(rank: int, nproc: int, rounds: int = 7) -> dict:
    """Seconds fourd's TP and FSDP add to a tiny layer's forward and backward on 2 ranks (models of 1 and 3
    layers). A step adds up every layer's time, so its typical cost counts, not the luckiest: the models take
    turns over `rounds` rounds (machine noise falls on all alike) and the median round is kept."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fourd.model.config import ModelConfig
    from fourd.model.llama import build_model
    from fourd.parallel.dp import apply_dp
    from fourd.parallel.tp import apply_tp

    mesh, x = init_device_mesh("cpu", (2,)), torch.randint(0, 64, (1, 16))
    wraps = {
        "plain": lambda m: m,
        "tp": lambda m: apply_tp(m, mesh),
        "fsdp": lambda m: apply_dp(m, mesh, 3),
    }
    config: dict = dict(dim=64, ffn=128, heads=4, kv_heads=2, vocab=64)
    models = {
        (k, n): w(build_model(ModelConfig(layers=n, **config), 0))
        for k, w in wraps.items()
        for n in (1, 3)
    }

    def one_pass(
        model,
    ) -> float:  # both ranks run the same passes: each meets the other in the collectives
        t0 = time.perf_counter()
        model(x).float().sum().backward()
        return time.perf_counter() - t0

    for model in models.values():
        one_pass(model)  # warm-up
    runs = [
        {key: statistics.median(one_pass(m) for _ in range(5)) for key, m in models.items()}
        for _ in range(rounds)
    ]
    return {
        k: statistics.median((r[k, 3] - r[k, 1] - r["plain", 3] + r["plain", 1]) / 2 for r in runs)
        for k in wraps
    }


def _machine(device: str) -> dict:
    """What is read, not measured: the device's name, memory and SMs, the devices per node, the peak."""
    import torch

    from fourd.config import fourd_home
    from fourd.measure.peak import device_peak_flops

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        peak = device_peak_flops("cuda", fourd_home())[0] / 1e12
        return {
            "name": props.name,
            "memory_gb": props.total_memory / 1e9,
            "sms": props.multi_processor_count,
            "devices": torch.cuda.device_count(),
            "peak_tflops": peak,
        }
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    name = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.machine(),
    )
    return {
        "name": f"{name}, one worker process",
        "memory_gb": total / 1e9 / CPU_DEVICES,
        "sms": None,
        "devices": CPU_DEVICES,
        "cores": os.cpu_count() or 1,
    }


def measure(plan: str, device: str = "cpu") -> dict:
    """Every figure of the profile, measured now on `device`."""
    import torch

    from fourd.comm.launch import run_workers

    sweep, m = PLANS[plan], _machine(device)
    scale = GPU_SCALE if device == "cuda" else 1
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m.update(
            gemm=[(n, gemm_tflops(n, device=device)) for n in sweep.squares],
            gemm_shapes=training_gemms(
                [t * scale for t in sweep.tokens], [d * scale for d in sweep.dims], device
            ),
            attention=attention_rates(sweep.seqs, sweep.head_dims, device),
            copy_gbps=copy_gbps(device),
            elementwise_gbps=elementwise_rate(device),
            optimizer_gbps=optimizer_rate(device),
        )
    finally:
        torch.set_num_threads(before)
    nproc = min(max(sweep.groups), m["devices"])
    workers = (
        run_workers(_workers, nproc, (m.get("cores", 0), sweep), timeout_s=600)
        if nproc >= 2
        else []
    )
    rows = workers[0]["rows"] if workers else []
    m["fits"] = {
        (op, g): fit_alpha_beta(
            [(r["bytes"], r["time_s"]) for r in rows if (r["op"], r["nproc"]) == (op, g)]
        )
        for op in (*OPS, "send")
        for g in sweep.groups
        if g <= nproc and (op != "send" or g == 2)
    }
    if device == "cpu":
        # One worker per core, as `fourd train` runs, keeps every core busy even when other work delays one;
        # a threaded matmul waits for its slowest thread, so on a busy machine it can fall below that sum.
        threaded = [gemm_tflops(n, threads=m["cores"], seconds=0.3) for n in (512, 1024, 2048)]
        m["concurrent_tflops"] = sum(w["concurrent_tflops"] for w in workers)
        m["peak_tflops"] = max(threaded + [m["concurrent_tflops"]] + [t for _, t in m["gemm"]])
        over = run_workers(_layer_overheads, 2, (), timeout_s=300)[0]
        # beyond the collectives' latency, which the planner counts apart: TP all-reduces twice forward and
        # twice backward; ZeRO 3 gathers a layer forward and backward and reduce-scatters its gradients
        alpha = {op: m["fits"][(op, 2)][0] for op in OPS}
        m["tp_layer_s"] = max(0.0, over["tp"] - 4 * alpha["all_reduce"])
        m["fsdp_layer_s"] = max(
            0.0, over["fsdp"] - 2 * alpha["all_gather"] - alpha["reduce_scatter"]
        )
    return m


def _samples(m: dict) -> list[str]:
    out, att = (
        [],
        ("seq", "head_dim", "fwd_tflops", "bwd_tflops", "masked_fwd_tflops", "masked_bwd_tflops"),
    )
    for table, keys, rows in (
        ("gpu.gemm", ("m", "n", "k", "tflops"), [(n, n, n, t) for n, t in m["gemm"]]),
        ("gpu.gemm_shapes", ("m", "n", "k", "tflops"), m["gemm_shapes"]),
        ("gpu.attention", att, m["attention"]),
        (
            "collectives",
            ("op", "nproc", "alpha_s", "beta_s_per_byte"),
            [(op, g, a, b) for (op, g), (a, b) in m["fits"].items()],
        ),
    ):
        for row in rows:
            out += [
                f"[[{table}]]",
                *(
                    f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v:.6g}"
                    for k, v in zip(keys, row)
                ),
                "",
            ]
    return out


def profile_toml(m: dict, command: str) -> str:
    """The `local` cluster profile in the planner's schema (fourd.plan.cluster) from `measure`'s figures."""
    cpu, today = m["sms"] is None, datetime.date.today().isoformat()
    alpha, beta = m["fits"].get(
        ("send", 2), (5e-6, 1 / (m["copy_gbps"] * 1e9))
    )  # one device: its own copies
    link = f"{1 / beta / 1e9:.4g}   # {'send/recv between two workers' if ('send', 2) in m['fits'] else 'no second device'}"
    out = [
        "# Written by `fourd calibrate`; rerun it to refresh.",
        'name = "local"',
        f'description = "{m["name"]} x {m["devices"]}, measured on {today}"',
        f'dtype = "{"fp32" if cpu else "bf16"}"',
        "",
        "[gpu]",
        f'name = "{m["name"]}"',
        f"peak_tflops = {m['peak_tflops']:.6g}   # {'best FP32 matmul, all cores' if cpu else 'datasheet dense BF16'}",
        f"memory_gb = {m['memory_gb']:.4g}",
        f"hbm_bw_gbps = {m['copy_gbps']:.4g}   # a 64 MB copy, read and write",
        f"elementwise_gbps = {m['elementwise_gbps']:.4g}   # fourd's eager block ops, in fourd.plan.block's bytes",
        f"optimizer_gbps = {m['optimizer_gbps']:.4g}   # AdamW, in the planner's 32 bytes per parameter",
    ]
    if cpu:
        out += [
            f"tp_layer_us = {m['tp_layer_s'] * 1e6:.4g}",
            f"fsdp_layer_us = {m['fsdp_layer_s'] * 1e6:.4g}",
        ]
    else:
        out += [f"sms = {m['sms']}", "memory_reserve_gb = 1.0   # the CUDA context"]
    out += [
        "",
        "[node]",
        f"gpus = {m['devices']}",
        f"intra_bw_gbps = {link}",
        f"intra_latency_us = {alpha * 1e6:.4g}",
    ]
    out += [f"concurrent_ranks = {m['cores']}   # workers beyond this share cores"] if cpu else []
    out += [
        "",
        "[network]   # not measured: the node's own figures",
        f"nic_bw_gbps = {1 / beta / 1e9:.4g}",
        f"latency_us = {alpha * 1e6:.4g}",
        f"gpus_per_rack = {m['devices']}",
        f"gpus_per_pod = {m['devices']}",
        "",
        "[calibration]",
        f'date = "{today}"',
        f'command = "{command}"',
        "",
    ]
    return "\n".join(out + _samples(m))


def add_arguments(p):
    p.add_argument(
        "--out", help="where to write the profile (default $FOURD_HOME/clusters/local.toml)"
    )
    p.add_argument("--quick", action="store_true", help="a coarser, smaller sweep (seconds)")
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: CUDA if present"
    )


def run(args) -> int:
    import torch

    from fourd.config import fourd_home
    from fourd.plan.cluster import load_cluster

    device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device == "cuda" and not torch.cuda.is_available():
        raise FourdError("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    out = Path(args.out) if args.out else fourd_home() / "clusters" / "local.toml"
    if out.suffix != ".toml" or out.is_dir():
        raise FourdError(
            f"--out {out}: the planner reads .toml profile files; give a file path ending in .toml"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FourdError(
            f"--out {out}: cannot create {out.parent} ({e.strerror}); choose a writable path"
        ) from None
    m = measure("quick" if args.quick else "full", device)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(
        profile_toml(m, f"fourd calibrate{' --quick' if args.quick else ''} --device {device}")
    )
    os.replace(tmp, out)
    c = load_cluster(str(out))
    rates = sorted(g.tflops for g in c.gpu.gemm_shapes)
    print(
        f"wrote {out}\n  {c.gpu.name}: peak {c.gpu.peak_tflops * 1e3:.1f} GFLOP/s; training-shape GEMMs {rates[0] * 1e3:.1f} "
        f"to {rates[-1] * 1e3:.1f} GFLOP/s over {len(rates)} shapes; copy {c.gpu.hbm_bw_gbps:.2f} GB/s, eager block "
        f"ops {c.gpu.elementwise_gbps:.2f} GB/s, AdamW {c.gpu.optimizer_gbps:.2f} GB/s"
    )
    for s in c.collectives:
        print(
            f"  {s.op:>14} x{s.nproc}: alpha {s.alpha_s * 1e6:8.1f} us  1/beta {1 / s.beta_s_per_byte / 1e9:6.3f} GB/s"
        )
    if c.cpu:
        print(
            f"  CPU time per layer: tensor parallelism {c.gpu.tp_layer_us:.0f} us, FSDP {c.gpu.fsdp_layer_us:.0f} us"
        )
    return 0
