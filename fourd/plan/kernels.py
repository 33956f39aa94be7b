"""One kernel's time: GEMMs, attention, memory-bound work, the optimizer update, collectives.
Seconds, bytes, FLOP/s; a profile's measured samples (`fourd calibrate`) win over the models;
docs/planner.md sources each figure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from fourd.comm import bus_factor
from fourd.plan.cluster import Cluster, Group, group_bandwidth

KERNEL_LAUNCH_S = 4e-6  # CUDA kernel launch and tail, per GEMM on a GPU
GPU_TILES = (
    (128, 128),
    (128, 256),
    (256, 128),
)  # output tiles cuBLAS picks among for large BF16 GEMMs
GEMM_TILE = (128, 256)  # the output tile a Hopper or Ampere BF16 GEMM runs its main loop on
# Fitted (benchmarks/validate_planner.py --fit, the fit rows only): a training step's GEMMs over the
# same GEMM benchmarked alone
TRAINING_GEMM_FACTOR = 0.8958
# a tile's prologue and epilogue, seconds: the first loads and the output's store
GEMM_TILE_LATENCY_S = 9.707e-06
FA_BACKWARD_FLOPS = (
    2.5  # FlashAttention's backward redoes QK^T: 5 matmuls to the forward's 2 (Dao 2023 §3.1)
)
FA_HALF_LENGTH = 384  # attention kernels lose efficiency on short sequences: eff · L/(L+384)
ADAM_BYTES = {
    2: 30,
    4: 32,
}  # HBM bytes per owned parameter in an Adam update (read+write states, grad, weight)
HBM_EFFICIENCY = 0.9  # fused memory-bound kernels stream at this share of the datasheet bandwidth
EAGER_HBM_EFFICIENCY = 0.9  # torch's eager elementwise kernels


def _wave_utilization(m: int, n: int, sms: int) -> float:
    """Fraction of the SMs doing useful work when an m×n output is cut into tiles run in waves: the
    output's share of the tiles of all the waves, for the best tile."""
    return max(
        m * n / (tm * tn * sms * math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / sms))
        for tm, tn in GPU_TILES
    )


def _interpolate(samples: Sequence[tuple[Sequence[float], float]], point: Sequence[float]) -> float:
    """A measured value at `point`: inverse-distance weighting (power 4) in log2 coordinates clamped
    to the samples' range; samples at the point itself are averaged."""
    logs = [tuple(math.log2(c) for c in where) for where, _ in samples]
    q = [min(max(math.log2(c), min(cs)), max(cs)) for c, cs in zip(point, zip(*logs))]
    hits, weights, total = [], 0.0, 0.0
    for where, (_, value) in zip(logs, samples):
        d2 = sum((a - b) ** 2 for a, b in zip(where, q))
        if d2 < 1e-12:
            hits.append(value)
        elif not hits:
            w = 1.0 / (d2 * d2)
            weights, total = weights + w, total + w * value
    return sum(hits) / len(hits) if hits else total / weights


def sustained_fraction(cluster: Cluster) -> float:
    """The share of the datasheet peak a training step's large GEMMs sustain: the profile's declared
    `gemm_efficiency` if it has one, else

        gemm_peak_fraction · min(1, (power_limit_w / gemm_measured_at_w)^(1/3)) ·
        TRAINING_GEMM_FACTOR

    the best published cuBLAS rate over peak, the clock a lower power limit sustains (dynamic power
    grows with f·V² and V with f, so f ∝ P^(1/3)), and the fitted share a GEMM keeps inside a
    training step."""
    gpu = cluster.gpu
    if gpu.gemm_efficiency:
        return gpu.gemm_efficiency
    clock = 1.0
    if gpu.power_limit_w and gpu.gemm_measured_at_w:
        clock = min(1.0, (gpu.power_limit_w / gpu.gemm_measured_at_w) ** (1 / 3))
    return gpu.gemm_peak_fraction * clock * TRAINING_GEMM_FACTOR


def tile_k_overhead(cluster: Cluster) -> float:
    """A tile's prologue and epilogue in units of the inner dimension k: the GEMM_TILE_LATENCY_S a
    tile spends outside its main loop, at the rate one SM runs that loop,

        k_overhead = latency · (peak / SMs) / (2 · tile_m · tile_n)

    so a faster SM (Hopper's 7.5 TFLOP/s to Ampere's 2.9) loses more of a short k to it."""
    gpu = cluster.gpu
    per_sm = gpu.peak_tflops * 1e12 * sustained_fraction(cluster) / (gpu.sms or 1)
    return GEMM_TILE_LATENCY_S * per_sm / (2 * GEMM_TILE[0] * GEMM_TILE[1])


@lru_cache(maxsize=65536)
def gemm_time(
    m: int,
    n: int,
    k: int,
    cluster: Cluster,
    dtype_bytes: int = 2,
    launch_s: float = KERNEL_LAUNCH_S,
) -> float:
    """Seconds for one (m×k)·(k×n) GEMM: measured samples if the profile has them, else the slower
    of the sustained rate cut by wave quantization and each tile's prologue, and the three matrices'
    bytes over HBM, plus `launch_s` on a GPU (the stack's launch gap: none under CUDA graphs).

        compute = 2·m·n·k / (peak · sustained_fraction · waves(m, n) · k / (k + tile_k_overhead))
        memory  = dtype_bytes · (m·k + k·n + m·n) / (HBM bandwidth · HBM_EFFICIENCY)"""
    gpu = cluster.gpu
    flops = 2.0 * m * n * k
    if gpu.gemm_shapes:
        return flops / (
            _interpolate([((s.m, s.n, s.k), s.tflops) for s in gpu.gemm_shapes], (m, n, k)) * 1e12
        )
    if gpu.gemm:
        return flops / (
            _interpolate([((2 * s.m * s.n * s.k,), s.tflops) for s in gpu.gemm], (flops,)) * 1e12
        )
    if gpu.sms:
        k_overhead = tile_k_overhead(cluster)
        util = _wave_utilization(m, n, gpu.sms) * k / (k + k_overhead)
    else:
        util = 1.0
    compute = flops / (gpu.peak_tflops * 1e12 * sustained_fraction(cluster) * util)
    memory = dtype_bytes * (m * k + k * n + m * n) / (gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9)
    if not gpu.sms:  # a CPU: no launch gap
        return max(compute, memory)
    return max(compute, memory) + launch_s


def elementwise_time(nbytes: float, cluster: Cluster, fused: bool = True) -> float:
    """Seconds of memory-bound kernels moving `nbytes` (counted by fourd.plan.block): a profile's
    measured rate, else HBM bandwidth at HBM_EFFICIENCY for fused kernels and at
    EAGER_HBM_EFFICIENCY for torch's one-kernel-per-op eager ones (`fused` False)."""
    if cluster.gpu.elementwise_gbps:
        return nbytes / cluster.gpu.elementwise_gbps / 1e9
    efficiency = HBM_EFFICIENCY if fused else EAGER_HBM_EFFICIENCY
    return nbytes / (cluster.gpu.hbm_bw_gbps * efficiency) / 1e9


def optimizer_time(params: float, cluster: Cluster, dtype_bytes: int = 2) -> float:
    """Seconds of an Adam update of `params` parameters: ADAM_BYTES each at HBM bandwidth, or
    measured."""
    rate = cluster.gpu.optimizer_gbps or cluster.gpu.hbm_bw_gbps * HBM_EFFICIENCY
    return params * ADAM_BYTES[dtype_bytes] / (rate * 1e9)


def _measured_attention(
    kv_len: int, head_dim: int, causal: bool, cluster: Cluster
) -> tuple[float, float]:
    """(forward, backward) FLOP/s of the profile's measured attention at (kv_len, head_dim); not
    causal, the explicit-mask kernel's rates where every sample has them."""
    samples = cluster.gpu.attention
    masked = not causal and all(s.masked_fwd_tflops and s.masked_bwd_tflops for s in samples)
    rates = []
    for direction in ("fwd", "bwd"):
        name = f"masked_{direction}_tflops" if masked else f"{direction}_tflops"
        points = [((s.seq, s.head_dim), float(getattr(s, name) or 0)) for s in samples]
        rates.append(_interpolate(points, (kv_len, head_dim)) * 1e12)
    return rates[0], rates[1]


def attention_time(
    q_tokens: int,
    kv_len: int,
    heads: int,
    head_dim: int,
    cluster: Cluster,
    causal: bool = True,
    kernel: str = "fa2",
) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention, q_tokens queries per head against kv_len keys
    (causal: half the pairs; measured rates win, non-causal ones there from the explicit-mask
    kernel). `kernel` "fa3" takes the profile's FlashAttention-3 efficiencies where it has them
    (Hopper), else FlashAttention 2's.

        forward FLOPs = 4 · pairs · head_dim · heads, backward FA_BACKWARD_FLOPS times that, at
        peak · efficiency · kv_len / (kv_len + FA_HALF_LENGTH)"""
    gpu = cluster.gpu
    pairs = q_tokens * kv_len * (0.5 if causal else 1.0)
    fwd_flops = 4.0 * pairs * head_dim * heads
    bwd_flops = fwd_flops * FA_BACKWARD_FLOPS
    if gpu.attention:
        fwd_rate, bwd_rate = _measured_attention(kv_len, head_dim, causal, cluster)
        return fwd_flops / fwd_rate, bwd_flops / bwd_rate
    if gpu.attention_fwd_efficiency is None:
        # No fused-kernel figure: two batched matmuls, at the measured GEMM rate.
        per_head = gemm_time(q_tokens, kv_len, head_dim, cluster) * 2 * (0.5 if causal else 1.0)
        return per_head * heads, per_head * heads * FA_BACKWARD_FLOPS
    fwd_eff = gpu.attention_fwd_efficiency
    bwd_eff = gpu.attention_bwd_efficiency or fwd_eff
    if kernel == "fa3" and gpu.fa3_fwd_efficiency:
        fwd_eff = gpu.fa3_fwd_efficiency
        bwd_eff = gpu.fa3_bwd_efficiency or fwd_eff
    peak = gpu.peak_tflops * 1e12 * kv_len / (kv_len + FA_HALF_LENGTH)
    return fwd_flops / (peak * fwd_eff), bwd_flops / (peak * bwd_eff)


# ---- collectives: nccl-tests conventions, the one table of fourd
# --------------------------------------

# bytes each rank sends = factor · nbytes (nbytes: all-gather's output, reduce-scatter's input), and
# ring steps latency steps: a ring's n−1 (all-reduce 2(n−1)); NCCL's double binary tree all-reduces
# in 2·log2(n)
_STEPS = {
    "all_reduce": lambda n: min(2 * (n - 1), 2 * math.ceil(math.log2(n))),
    "send": lambda n: 1,
}


@lru_cache(maxsize=65536)
def collective_time(op: str, nbytes: float, group: Group, cluster: Cluster) -> float:
    """Seconds for a collective on an nbytes buffer over `group`, at the bandwidth its placement
    gives. A measured fit in the profile for this op and group size wins over the ring model."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    for s in cluster.collectives:
        if s.op == op and s.nproc == (
            2 if op == "send" else n
        ):  # a send pairs two ranks of any group
            share = cluster.core_share(group.world) / cluster.core_share(
                s.nproc
            )  # measured with s.nproc busy
            return (s.alpha_s + s.beta_s_per_byte * nbytes) * share
    bw, latency = group_bandwidth(
        group, cluster, 1 if op == "send" else None
    )  # a send: one NIC each end
    return _STEPS.get(op, lambda n: n - 1)(n) * latency + bus_factor(op, n) * nbytes / bw
