"""Measure this machine and write its cluster profile, `local` (`fourd plan --cluster local`): on a
CUDA device one GPU in BF16, on CPUs one worker process of `fourd train` in FP32 (what is measured:
docs/planner.md). Under a minute on CPUs; --quick: a coarser sweep in seconds.

With --nccl-tests it measures nothing: it fits a cluster's network (the latency of a step between
servers and the fraction of the NIC's rate collectives reach) to nccl-tests run on two or more nodes
and writes the --cluster profile with that network (fourd.plan.netfit), by default as
$FOURD_HOME/clusters/BASE-nccl.toml.

examples:
  fourd calibrate
  fourd calibrate --quick --out /tmp/local.toml
  fourd calibrate --rounds 3          # on a shared machine: each figure the median of 3 rounds
  fourd calibrate --nccl-tests all_reduce_perf.log all_gather_perf.log --cluster dgx-h100
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections import Counter, namedtuple
from pathlib import Path
from typing import TYPE_CHECKING

from fourd.errors import FourdError
from fourd.measure.timing import best_seconds, gemm_tflops, torch_for

if TYPE_CHECKING:
    from fourd.model.config import ModelConfig

CPU_DEVICES = 8  # CPU worker processes taken as one node
OPS = ("all_reduce", "all_gather", "reduce_scatter")
SMALL_MESSAGE = 1 << 14  # bytes; messages at most this size time the latency (alpha)
LARGE_MESSAGE = 1 << 18  # bytes; messages at least this size time mostly the bandwidth (beta)


# square matmul sizes, collective group sizes and message bytes, iterations, training-shape GEMMs'
# tokens and widths (in, out), attention's sequence lengths and head sizes
Sweep = namedtuple("Sweep", "squares groups messages iters tokens dims seqs head_dims")

PLANS = {
    "full": Sweep(
        squares=(16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048),
        groups=(2, 4, 8),
        messages=tuple(1 << exponent for exponent in range(10, 26, 2)),
        iters=10,
        tokens=(256, 1024, 4096),
        dims=(64, 256, 1024),
        seqs=(64, 256, 1024),
        head_dims=(16, 32, 64, 128),
    ),
    "quick": Sweep(
        squares=(16, 32, 64, 128, 256),
        groups=(2, 4),
        messages=(1 << 10, 1 << 14, 1 << 20, 1 << 22),
        iters=4,
        tokens=(256, 1024),
        dims=(64, 256),
        seqs=(128, 256),
        head_dims=(32,),
    ),
}
GPU_SCALE = 8  # on a GPU the training shapes are this many times larger (tokens and widths)


def _scale(device: str) -> int:
    """How many times larger the training shapes are on `device`."""
    if device == "cuda":
        return GPU_SCALE
    return 1


def _precision(device: str) -> str:
    """What the planner computes in on `device`: BF16 on a GPU, FP32 on CPUs."""
    if device == "cuda":
        return "bf16"
    return "fp32"


SAMPLE_S = 0.03  # timed per training-shape sample (best of batches)


def training_gemms(tokens, dims, device: str = "cpu", seconds: float = SAMPLE_S) -> list[tuple]:
    """(m, n, k, TFLOP/s) of a linear layer's three GEMMs as autograd runs them for every token
    count and (in, out): forward (tokens, out, in), input gradient (tokens, in, out), weight
    gradient (in, out, tokens)."""
    torch, dtype, _ = torch_for(device)
    out = []
    for count in tokens:
        for width_in in dims:
            for width_out in dims:
                inputs, weight, grad_out = (
                    torch.randn(*size, dtype=dtype, device=device)
                    for size in ((count, width_in), (width_out, width_in), (count, width_out))
                )
                flops = 2 * count * width_in * width_out / 1e12
                for shape, gemm in (
                    ((count, width_out, width_in), lambda: inputs @ weight.t()),
                    ((count, width_in, width_out), lambda: grad_out @ weight),
                    ((width_in, width_out, count), lambda: grad_out.t() @ inputs),
                ):
                    out.append((*shape, flops / best_seconds(gemm, seconds, device)))
    return out


def attention_rates(seqs, head_dims, device: str = "cpu", seconds: float = SAMPLE_S) -> list[tuple]:
    """(seq, head_dim, forward and backward TFLOP/s with is_causal, the same with an explicit causal
    mask) of torch's SDPA in the planner's FLOPs (is_causal: seq²/2 pairs; an explicit mask computes
    all seq²)."""
    torch, dtype, _ = torch_for(device)
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out = []
    for seq in seqs:
        for head_dim in head_dims:
            heads = max(
                1, (1 << 22) // (seq * seq)
            )  # about 4M query-key pairs per call, a microbatch's
            query, key, value = (
                torch.randn(1, seq, heads, head_dim, dtype=dtype, device=device)
                .transpose(1, 2)
                .requires_grad_()
                for _ in range(3)
            )
            grad, mask = (
                torch.randn_like(query),
                torch.ones(seq, seq, dtype=torch.bool, device=device).tril(),
            )
            rates = []
            for mask_args, pairs in (
                ({"is_causal": True}, seq * seq / 2),
                ({"attn_mask": mask}, seq * seq),
            ):
                flops = 4 * pairs * head_dim * heads / 1e12
                fwd = best_seconds(
                    lambda mask_args=mask_args: sdpa(query, key, value, **mask_args),
                    seconds,
                    device,
                )
                both = best_seconds(
                    lambda mask_args=mask_args: sdpa(query, key, value, **mask_args).backward(grad),
                    seconds,
                    device,
                )
                rates += [flops / fwd, 2.5 * flops / max(both - fwd, 1e-9)]
            out.append((seq, head_dim, *rates))
    return out


def elementwise_rate(device: str = "cpu", tokens: int = 4096, seconds: float = 0.1) -> float:
    """GB/s, in fourd.plan.block's counted bytes, of a `small` layer's memory-bound ops run as the
    model does: two RMSNorms, RoPE on q and k, the GQA repeat of k and v, SiLU·mul, two residual
    adds, forward and backward."""
    from fourd.model.config import get_preset

    cfg, seq = get_preset("small"), 256
    tokens *= _scale(device)
    total = _block_ops_seconds(cfg, seq, tokens, device, seconds)
    return tokens * _block_bytes_per_token(cfg, seq, device) / total / 1e9


def _block_ops_seconds(
    cfg: ModelConfig, seq: int, tokens: int, device: str, seconds: float
) -> float:
    """Seconds of one forward and backward of the layer's memory-bound ops over `tokens` tokens."""
    torch, dtype, _ = torch_for(device)
    import torch.nn.functional as F

    from fourd.model.llama import RMSNorm, apply_rope, rope_table

    cos, sin = (
        tensor.to(device) for tensor in rope_table(cfg.head_dim, torch.arange(seq), cfg.rope_theta)
    )
    norms = [RMSNorm(cfg.dim, cfg.norm_eps).to(device) for _ in range(2)]

    def leaf(*shape):
        return torch.randn(tokens // seq, seq, *shape, dtype=dtype, device=device).requires_grad_()

    hidden, attn, ffn_out, gate, up_proj = (
        leaf(cfg.dim),
        leaf(cfg.dim),
        leaf(cfg.dim),
        leaf(cfg.ffn),
        leaf(cfg.ffn),
    )
    query, key, value = (
        leaf(cfg.heads, cfg.head_dim),
        leaf(cfg.kv_heads, cfg.head_dim),
        leaf(cfg.kv_heads, cfg.head_dim),
    )

    def forward():
        residual, rep = hidden + attn, cfg.heads // cfg.kv_heads
        keys_values = [
            tensor.transpose(1, 2).repeat_interleave(rep, dim=1)
            for tensor in (apply_rope(key, cos, sin), value)
        ]
        return [
            norms[0](hidden),
            apply_rope(query, cos, sin),
            *keys_values,
            norms[1](residual),
            F.silu(gate) * up_proj,
            residual + ffn_out,
        ]

    grads = [torch.randn_like(tensor) for tensor in forward()]
    return best_seconds(lambda: torch.autograd.backward(forward(), grads), seconds, device)


def _block_bytes_per_token(cfg: ModelConfig, seq: int, device: str) -> float:
    """Bytes per token that fourd.plan.block counts for the layer's ops, forward plus backward."""
    from fourd.layout import Layout, Parallelism
    from fourd.plan.block import traffic
    from fourd.plan.cluster import load_cluster
    from fourd.plan.job import Job

    job = Job(
        model=cfg,
        cluster=load_cluster("dgx-h100"),
        par=Parallelism(layout=Layout(dp=2)),
        seq=seq,
        global_seqs=2,
        precision=_precision(device),
    )
    counted = traffic(job.work)
    return counted.forward + counted.backward


def optimizer_rate(device: str = "cpu", seconds: float = 0.1) -> float:
    """GB/s, in the planner's 32 bytes per FP32 parameter, of torch's AdamW on the `small` model:
    one tensor at a time on CPUs (foreach=False, as the trainer), fused on CUDA (as
    benchmarks/gpu_step.py)."""
    torch, _, _ = torch_for(device)
    from fourd.model.config import get_preset
    from fourd.model.llama import build_model
    from fourd.plan.kernels import ADAM_BYTES

    params = list(build_model(get_preset("small"), 0, device).parameters())
    for param in params:
        param.grad = torch.randn_like(param)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False, fused=device == "cuda")
    return (
        sum(param.numel() for param in params)
        * ADAM_BYTES[4]
        / best_seconds(opt.step, seconds, device)
        / 1e9
    )


def copy_gbps(device: str = "cpu", nbytes: int = 64 << 20) -> float:
    """Memory bandwidth of one thread copying a large tensor: bytes read plus bytes written, per
    second."""
    torch, _, _ = torch_for(device)
    src, dst = torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), 0.05, device) / 1e9


def fit_alpha_beta(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(alpha s, beta s/byte) of t = alpha + beta·bytes: alpha the median of small messages, beta
    the slope over the large ones (or, when other work inflates the small ones, the largest
    message's time per byte)."""
    alpha = statistics.median(seconds for size, seconds in points if size <= SMALL_MESSAGE)
    large = [(size, seconds - alpha) for size, seconds in points if size >= LARGE_MESSAGE]
    beta = sum(size * seconds for size, seconds in large) / sum(size * size for size, _ in large)
    if beta <= 0:
        largest_bytes, largest_s = max(points)
        beta = largest_s / largest_bytes
    return alpha, beta


def _workers(rank: int, nproc: int, cores: int, sweep: Sweep) -> dict:
    """One worker's share: on CPUs the matmul rate while one worker per core does the same, then
    collectives."""
    import torch.distributed as dist

    from fourd.comm.bench import time_op

    on_cpu = dist.get_backend() != "nccl"
    dist.barrier()
    concurrent = 0.0
    if rank < cores and on_cpu:
        concurrent = gemm_tflops(512, seconds=0.3)
    dist.barrier()
    rows = []
    groups = {size: dist.new_group(list(range(size))) for size in sweep.groups if size <= nproc}
    for size, group in groups.items():
        if rank < size:
            rows += [
                time_op(op, message, sweep.iters, 1, group)
                for op in OPS
                for message in sweep.messages
            ]
    if rank < 2:
        rows += [
            dict(time_op("sendrecv", message, sweep.iters, 1, groups[2]), op="send")
            for message in sweep.messages
        ]
    dist.barrier()
    return {"rows": rows, "concurrent_tflops": concurrent}


def _layer_overheads(rank: int, nproc: int, rounds: int = 7) -> dict:
    """Seconds fourd's TP and FSDP add to a tiny layer's forward and backward on 2 ranks (models of
    1 and 3 layers). A step adds up every layer's time, so its typical cost counts, not the
    luckiest: the models take turns over `rounds` rounds (machine noise falls on all alike) and the
    median round is kept. Per layer: ((t₃ − t₁) − (plain₃ − plain₁)) / 2, t the wrapped model's
    pass, plain the unwrapped one's, subscripts the layers."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fourd.model.config import ModelConfig
    from fourd.model.llama import build_model
    from fourd.parallel.dp import apply_dp
    from fourd.parallel.tp import apply_tp

    mesh, tokens = init_device_mesh("cpu", (2,)), torch.randint(0, 64, (1, 16))
    wraps = {
        "plain": lambda net: net,
        "tp": lambda net: apply_tp(net, mesh),
        "fsdp": lambda net: apply_dp(net, mesh, 3),
    }
    config: dict = dict(dim=64, ffn=128, heads=4, kv_heads=2, vocab=64)
    models = {
        (kind, layers): wrap(build_model(ModelConfig(layers=layers, **config), 0))
        for kind, wrap in wraps.items()
        for layers in (1, 3)
    }

    def one_pass(
        model,
    ) -> float:  # both ranks run the same passes: each meets the other in the collectives
        began = time.perf_counter()
        model(tokens).float().sum().backward()
        return time.perf_counter() - began

    for model in models.values():
        one_pass(model)  # warm-up
    runs = [
        {key: statistics.median(one_pass(net) for _ in range(5)) for key, net in models.items()}
        for _ in range(rounds)
    ]
    return {
        kind: statistics.median(
            (medians[kind, 3] - medians[kind, 1] - medians["plain", 3] + medians["plain", 1]) / 2
            for medians in runs
        )
        for kind in wraps
    }


SYNC_LAYERS = 16  # layers of the sync-share loops


def _sync_loops(pattern: str, tokens: int):
    """(GEMMs alone, collectives alone, the two interleaved) of the sync-share loop with `pattern`:
    SYNC_LAYERS layers of a pair of GEMM pairs (tokens × 256 → 352 → 256 and 256 → 128 → 256: the
    `small` model's width, and its MLP and attention widths over TP = 2). "tp": each pair followed
    by an all-reduce of its output, as TP's layers run; "fsdp": each layer's forward (its two
    pairs) after an all-gather of half its weights, and each layer's backward (twice the forward's
    pairs) before a reduce-scatter of its weight gradients, as FSDP's layers run."""
    import torch

    dim, mlp_shard, attention_shard = 256, 352, 128
    activations = torch.randn(tokens, dim)
    weights = [
        torch.randn(dim, mlp_shard),
        torch.randn(mlp_shard, dim),
        torch.randn(dim, attention_shard),
        torch.randn(attention_shard, dim),
    ]

    def pair(first: int):
        """A GEMM pair's output: the MLP's (first = 0) or attention's (first = 2)."""
        return activations @ weights[first] @ weights[first + 1]

    if pattern == "tp":
        return _tp_loop(pair, torch.zeros(tokens, dim))
    return _fsdp_loop(pair, sum(weight.numel() for weight in weights))


def _tp_loop(pair, reduced):
    """The "tp" loop of _sync_loops: an all-reduce after every GEMM pair."""
    import torch.distributed as dist

    def gemms() -> None:
        for _ in range(SYNC_LAYERS):
            pair(0)
            pair(2)

    def collectives() -> None:
        for _ in range(2 * SYNC_LAYERS):
            dist.all_reduce(reduced)

    def interleaved() -> None:
        for _ in range(SYNC_LAYERS):
            dist.all_reduce(pair(0))
            dist.all_reduce(pair(2))

    return gemms, collectives, interleaved


def _fsdp_loop(pair, layer_elements: int):
    """The "fsdp" loop of _sync_loops: a forward after an all-gather of each layer's weights, a
    backward of twice its work before a reduce-scatter of their gradients."""
    import torch
    import torch.distributed as dist

    shard, whole = torch.zeros(layer_elements // 2), torch.zeros(layer_elements)

    def gemms() -> None:
        for _ in range(3 * SYNC_LAYERS):
            pair(0)
            pair(2)

    def collectives() -> None:
        for _ in range(SYNC_LAYERS):
            dist.all_gather_into_tensor(whole, shard)
            dist.reduce_scatter_tensor(shard, whole)

    def interleaved() -> None:
        for _ in range(SYNC_LAYERS):
            dist.all_gather_into_tensor(whole, shard)
            pair(0)
            pair(2)
        for _ in range(SYNC_LAYERS):
            for _ in range(2):
                pair(0)
                pair(2)
            dist.reduce_scatter_tensor(shard, whole)

    return gemms, collectives, interleaved


def _sync_share(
    rank: int, nproc: int, pattern: str = "tp", rounds: int = 7, tokens: int = 2048
) -> float:
    """The compute two workers lose waiting for each other at their collectives, as a share of the
    compute between them: the loop of `_sync_loops(pattern)` against its GEMMs alone and its
    collectives alone, in `rounds` alternating rounds; the median round's
    (interleaved − GEMMs − collectives) / GEMMs, at least 0. The ranks reach each collective apart,
    and the data each moves disturbs the compute after it."""
    import torch.distributed as dist

    gemms, collectives, interleaved = _sync_loops(pattern, tokens)

    def seconds(work) -> float:
        dist.barrier()
        began = time.perf_counter()
        work()
        return time.perf_counter() - began

    for work in (gemms, collectives, interleaved):  # warm-up
        seconds(work)
    shares = []
    for _ in range(rounds):
        alone, moved, together = seconds(gemms), seconds(collectives), seconds(interleaved)
        shares.append((together - alone - moved) / alone)
    return max(0.0, statistics.median(shares))


def _machine(device: str) -> dict:
    """What is read, not measured: the device's name, memory and SMs, the devices per node, the
    peak."""
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
    with open("/proc/meminfo") as meminfo:
        total = next(
            int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:")
        )
    name = next(
        (
            entry.split(":", 1)[1].strip()
            for entry in Path("/proc/cpuinfo").read_text().splitlines()
            if entry.startswith("model name")
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
    from fourd.comm.launch import run_workers

    sweep, machine = PLANS[plan], _machine(device)
    machine.update(_one_thread_rates(sweep, device))
    nproc = min(max(sweep.groups), machine["devices"])
    workers = []
    rows = []
    if nproc >= 2:
        workers = run_workers(_workers, nproc, (machine.get("cores", 0), sweep), timeout_s=600)
        rows = workers[0]["rows"]
    machine["fits"] = {
        (op, group_size): fit_alpha_beta(
            [
                (row["bytes"], row["time_s"])
                for row in rows
                if (row["op"], row["nproc"]) == (op, group_size)
            ]
        )
        for op in (*OPS, "send")
        for group_size in sweep.groups
        if group_size <= nproc and (op != "send" or group_size == 2)
    }
    if device == "cpu":
        machine.update(_cpu_figures(machine, workers))
    return machine


def median_figures(rounds: list):
    """The figure-by-figure median of several rounds of `measure`: every measured float the median
    of its rounds, a list, tuple or dict taken entry by entry (the sweep is the same each round, so
    its sizes and shapes are too); what is read, not measured (names, counts, sizes), from the
    first round. A shared machine's speed drifts over minutes: one round is one moment of it."""
    first = rounds[0]
    if isinstance(first, float):
        return statistics.median(rounds)
    if isinstance(first, dict):
        return {key: median_figures([one[key] for one in rounds]) for key in first}
    if isinstance(first, (list, tuple)):
        entries = [median_figures(list(column)) for column in zip(*rounds, strict=True)]
        return type(first)(entries)
    return first


def _one_thread_rates(sweep: Sweep, device: str) -> dict:
    """The device's matmul, attention, copy, eager block op and AdamW rates, on one CPU thread."""
    import torch

    scale = _scale(device)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return dict(
            gemm=[(size, gemm_tflops(size, device=device)) for size in sweep.squares],
            gemm_shapes=training_gemms(
                [count * scale for count in sweep.tokens],
                [width * scale for width in sweep.dims],
                device,
            ),
            attention=attention_rates(sweep.seqs, sweep.head_dims, device),
            copy_gbps=copy_gbps(device),
            elementwise_gbps=elementwise_rate(device),
            optimizer_gbps=optimizer_rate(device),
        )
    finally:
        torch.set_num_threads(before)


def _cpu_figures(machine: dict, workers: list[dict]) -> dict:
    """The CPU's concurrent and peak TFLOP/s and the seconds TP and FSDP add to each layer."""
    from fourd.comm.launch import run_workers

    # One worker per core, as `fourd train` runs, keeps every core busy even when other work
    # delays one; a threaded matmul waits for its slowest thread, so on a busy machine it can
    # fall below that sum.
    threaded = [
        gemm_tflops(size, threads=machine["cores"], seconds=0.3) for size in (512, 1024, 2048)
    ]
    concurrent = sum(worker["concurrent_tflops"] for worker in workers)
    peak = max(threaded + [concurrent] + [count for _, count in machine["gemm"]])
    over = run_workers(_layer_overheads, 2, (), timeout_s=300)[0]
    sync_share = run_workers(_sync_share, 2, ("tp",), timeout_s=300)[0]
    fsdp_sync_share = run_workers(_sync_share, 2, ("fsdp",), timeout_s=300)[0]
    # beyond the collectives' latency, which the planner counts apart: TP all-reduces twice
    # forward and twice backward; ZeRO 3 gathers a layer forward and backward and
    # reduce-scatters its gradients
    alpha = {op: machine["fits"][(op, 2)][0] for op in OPS}
    return {
        "concurrent_tflops": concurrent,
        "peak_tflops": peak,
        "tp_layer_s": max(0.0, over["tp"] - 4 * alpha["all_reduce"]),
        "fsdp_layer_s": max(0.0, over["fsdp"] - 2 * alpha["all_gather"] - alpha["reduce_scatter"]),
        "sync_share": sync_share,
        "fsdp_sync_share": fsdp_sync_share,
    }


def _samples(machine: dict) -> list[str]:
    out, att = (
        [],
        ("seq", "head_dim", "fwd_tflops", "bwd_tflops", "masked_fwd_tflops", "masked_bwd_tflops"),
    )
    for table, keys, rows in (
        (
            "gpu.gemm",
            ("m", "n", "k", "tflops"),
            [(size, size, size, tflops) for size, tflops in machine["gemm"]],
        ),
        ("gpu.gemm_shapes", ("m", "n", "k", "tflops"), machine["gemm_shapes"]),
        ("gpu.attention", att, machine["attention"]),
        (
            "collectives",
            ("op", "nproc", "alpha_s", "beta_s_per_byte"),
            [(op, nproc, alpha, beta) for (op, nproc), (alpha, beta) in machine["fits"].items()],
        ),
    ):
        for row in rows:
            out += [
                f"[[{table}]]",
                *(_toml_entry(key, value) for key, value in zip(keys, row)),
                "",
            ]
    return out


def _toml_entry(key: str, value) -> str:
    if isinstance(value, str):
        return f"{key} = {value!r}"
    return f"{key} = {value:.6g}"


def profile_toml(machine: dict, command: str) -> str:
    """The `local` cluster profile in the planner's schema (fourd.plan.cluster) from `measure`'s
    figures."""
    cpu = machine["sms"] is None
    today = datetime.date.today().isoformat()
    alpha, beta, link = _node_link(machine)
    dtype = "bf16"
    if cpu:
        dtype = "fp32"
    out = [
        "# Written by `fourd calibrate`; rerun it to refresh.",
        'name = "local"',
        f'description = "{machine["name"]} x {machine["devices"]}, measured on {today}"',
        f'dtype = "{dtype}"',
        "",
        *_gpu_table(machine, cpu),
        "",
        "[node]",
        f"gpus = {machine['devices']}",
        f"intra_bw_gbps = {link}",
        f"intra_latency_us = {alpha * 1e6:.4g}",
    ]
    if cpu:
        out.append(f"concurrent_ranks = {machine['cores']}   # workers beyond this share cores")
        out.append(
            f"sync_share = {machine['sync_share']:.4g}   # compute two workers lose waiting at their "
            "collectives, TP's"
        )
        out.append(
            f"fsdp_sync_share = {machine['fsdp_sync_share']:.4g}   # the same with FSDP's gathers "
            "and scatters"
        )
    out += [
        "",
        "[network]   # not measured: the node's own figures",
        f"nic_bw_gbps = {1 / beta / 1e9:.4g}",
        f"latency_us = {alpha * 1e6:.4g}",
        f"gpus_per_rack = {machine['devices']}",
        f"gpus_per_pod = {machine['devices']}",
        "",
        "[calibration]",
        f'date = "{today}"',
        f'command = "{command}"',
        "",
    ]
    return "\n".join(out + _samples(machine))


def _node_link(machine: dict) -> tuple[float, float, str]:
    """(alpha s, beta s/byte, intra_bw_gbps's value and comment) of the link between two devices."""
    if ("send", 2) in machine["fits"]:
        alpha, beta = machine["fits"][("send", 2)]
        link = f"{1 / beta / 1e9:.4g}   # send/recv between two workers"
    else:  # one device: its own copies, 5 us to start one
        alpha, beta = 5e-6, 1 / (machine["copy_gbps"] * 1e9)
        link = f"{1 / beta / 1e9:.4g}   # no second device"
    return alpha, beta, link


def _gpu_table(machine: dict, cpu: bool) -> list[str]:
    """The lines of the profile's [gpu] table, from its header to its last entry."""
    peak_source = "datasheet dense BF16"
    if cpu:
        peak_source = "best FP32 matmul, all cores"
    out = [
        "[gpu]",
        f'name = "{machine["name"]}"',
        f"peak_tflops = {machine['peak_tflops']:.6g}   # {peak_source}",
        f"memory_gb = {machine['memory_gb']:.4g}",
        f"hbm_bw_gbps = {machine['copy_gbps']:.4g}   # a 64 MB copy, read and write",
        f"elementwise_gbps = {machine['elementwise_gbps']:.4g}   # fourd's eager block ops, in "
        "fourd.plan.block's bytes",
        f"optimizer_gbps = {machine['optimizer_gbps']:.4g}   # AdamW, in the planner's "
        "32 bytes per parameter",
    ]
    if cpu:
        out += [
            f"tp_layer_us = {machine['tp_layer_s'] * 1e6:.4g}",
            f"fsdp_layer_us = {machine['fsdp_layer_s'] * 1e6:.4g}",
        ]
    else:
        out += [f"sms = {machine['sms']}", "memory_reserve_gb = 1.0   # the CUDA context"]
    return out


def add_arguments(parser):
    parser.add_argument(
        "--out",
        help="where to write the profile (default $FOURD_HOME/clusters/local.toml; with "
        "--nccl-tests, BASE-nccl.toml there)",
    )
    parser.add_argument("--quick", action="store_true", help="a coarser, smaller sweep (seconds)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure this many times and keep each figure's median (a shared machine's speed "
        "drifts; default 1)",
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: CUDA if present"
    )
    parser.add_argument(
        "--nccl-tests",
        nargs="+",
        metavar="FILE",
        help="fit --cluster's network to these nccl-tests outputs (or op,nodes,ranks,bytes,time_us "
        "CSVs) instead of measuring this machine",
    )
    parser.add_argument(
        "--cluster",
        help="with --nccl-tests: the profile (preset or .toml) whose network is fitted; the rest "
        "of it is kept",
    )


def run(args) -> int:
    from fourd.config import fourd_home
    from fourd.plan.cluster import load_cluster

    _check_flags(args)
    if args.nccl_tests:
        return _fit_network(args)
    out = fourd_home() / "clusters" / "local.toml"
    if args.out:
        out = Path(args.out)
    _check_out(out)
    device = _device(args.device)
    if args.quick:
        plan, command = "quick", f"fourd calibrate --quick --device {device}"
    else:
        plan, command = "full", f"fourd calibrate --device {device}"
    if args.rounds > 1:
        command += f" --rounds {args.rounds}"
    machine = median_figures([measure(plan, device) for _ in range(args.rounds)])
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(profile_toml(machine, command))
    os.replace(tmp, out)
    _print_profile(out, load_cluster(str(out)), args.rounds)
    return 0


def _check_flags(args) -> None:
    """Refuse flags that do not go together, before any work."""
    if args.nccl_tests and args.rounds != 1:
        raise FourdError(
            "--rounds repeats the measurement of this machine; --nccl-tests measures nothing: "
            "drop --rounds"
        )
    if args.cluster and not args.nccl_tests:
        raise FourdError(
            "--cluster names the profile --nccl-tests fits; give --nccl-tests FILE too"
        )
    if args.rounds < 1:
        raise FourdError(f"--rounds {args.rounds}: give 1 or more")


def _device(asked: str) -> str:
    """The device to measure: CUDA when present for "auto", else the CPU."""
    import torch

    if asked == "cuda" and not torch.cuda.is_available():
        raise FourdError("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return asked


def _print_profile(out: Path, cluster, rounds: int) -> None:
    """What the written profile says, as the planner read it back."""
    rates = sorted(shape.tflops for shape in cluster.gpu.gemm_shapes)
    medians = f" (each figure the median of {rounds} rounds)" if rounds > 1 else ""
    print(
        f"wrote {out}{medians}\n  {cluster.gpu.name}: peak {cluster.gpu.peak_tflops * 1e3:.1f} GFLOP/s; "
        f"training-shape GEMMs {rates[0] * 1e3:.1f} to {rates[-1] * 1e3:.1f} GFLOP/s over "
        f"{len(rates)} shapes; copy {cluster.gpu.hbm_bw_gbps:.2f} GB/s, eager block ops "
        f"{cluster.gpu.elementwise_gbps:.2f} GB/s, AdamW {cluster.gpu.optimizer_gbps:.2f} GB/s"
    )
    for fit in cluster.collectives:
        print(
            f"  {fit.op:>14} x{fit.nproc}: alpha {fit.alpha_s * 1e6:8.1f} us  1/beta "
            f"{1 / fit.beta_s_per_byte / 1e9:6.3f} GB/s"
        )
    if cluster.cpu:
        print(
            f"  CPU time per layer: tensor parallelism {cluster.gpu.tp_layer_us:.0f} us, FSDP "
            f"{cluster.gpu.fsdp_layer_us:.0f} us; two workers lose "
            f"{cluster.node.sync_share:.0%} (TP's collectives) and "
            f"{cluster.node.layer_sync_share:.0%} (FSDP's) of their compute waiting"
        )


def _check_out(out: Path) -> None:
    """Refuse an --out the planner could not read back or that cannot be written, before any work."""
    if out.suffix != ".toml" or out.is_dir():
        raise FourdError(
            f"--out {out}: the planner reads .toml profile files; give a file path ending in .toml"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise FourdError(
            f"--out {out}: cannot create {out.parent} ({error.strerror}); choose a writable path"
        ) from None


def _fit_network(args) -> int:
    """`fourd calibrate --nccl-tests`: fit --cluster's network to the files and write the profile,
    by default as $FOURD_HOME/clusters/BASE-nccl.toml (`--cluster BASE-nccl` plans on it)."""
    from fourd.config import fourd_home
    from fourd.plan.cluster import load_cluster
    from fourd.plan.netfit import NcclSample, fit_network, profile_with_network, read_samples

    if not args.cluster:
        raise FourdError(
            "--nccl-tests fits the network of a profile: give --cluster, e.g. --cluster dgx-h100"
        )
    if args.quick or args.device != "auto":
        raise FourdError("--nccl-tests measures nothing here; drop --quick and --device")
    base = load_cluster(args.cluster)
    out = fourd_home() / "clusters" / f"{base.name}-nccl.toml"
    if args.out:
        out = Path(args.out)
    _check_out(out)
    samples: list[NcclSample] = []
    left_out: Counter[str] = Counter()  # rows by the reason the fit leaves them out
    for path in args.nccl_tests:
        kept, skipped = read_samples(Path(path))
        samples += kept
        left_out.update(skipped)
    fit = fit_network(samples, base)
    files = " ".join(Path(path).name for path in args.nccl_tests)
    command = f"fourd calibrate --nccl-tests {files} --cluster {base.name}"
    text = profile_with_network(Path(base.source).read_text(), fit, out.stem, command)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp.toml")
    tmp.write_text(text)
    try:
        load_cluster(str(tmp.resolve()))  # what the planner will read, checked before it lands
    except FourdError:
        tmp.unlink()
        raise
    os.replace(tmp, out)
    _print_network_fit(out, base, fit, left_out)
    return 0


def _print_network_fit(out: Path, base, fit, left_out: Counter[str]) -> None:
    """The fitted network against the profile's own, the rows left out, and each collective's own
    fit where the files hold more than one."""
    from fourd.plan.netfit import fit_network

    samples = fit.samples
    print(
        f"wrote {out}\n  network of {base.name} fitted to {len(samples)} collectives across "
        f"servers: a step between servers {fit.latency_us:g} us (was "
        f"{base.network.latency_us:g}), NIC efficiency {fit.nic_efficiency:g} (was "
        f"{base.network.nic_efficiency:g}); mean error {fit.mean_error:.1%} (was "
        f"{fit.mean_error_before:.1%})"
    )
    if left_out:
        print(
            "  left out: "
            + ", ".join(
                f"{rows} row{'' if rows == 1 else 's'} {reason}"
                for reason, rows in sorted(left_out.items())
            )
        )
    ops = sorted({sample.op for sample in samples})
    if len(ops) == 1:
        return
    for op in ops:  # each collective's own fit: where they disagree, the model does
        alone = fit_network([sample for sample in samples if sample.op == op], base)
        print(
            f"  {op} alone: {alone.latency_us:g} us, NIC efficiency {alone.nic_efficiency:g}, mean "
            f"error {alone.mean_error:.1%} over {len(alone.samples)}"
        )
