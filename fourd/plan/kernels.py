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
GEMM_K_OVERHEAD = (
    380  # a tile's prologue and epilogue, in units of the inner dimension k: rate · k / (k + this)
)
FA_BACKWARD_FLOPS = (
    2.5  # FlashAttention's backward redoes QK^T: 5 matmuls to the forward's 2 (Dao 2023 §3.1)
)
FA_HALF_LENGTH = 384  # attention kernels lose efficiency on short sequences: eff · L/(L+384)
ADAM_BYTES = {
    2: 30,
    4: 32,
}  # HBM bytes per owned parameter in an Adam update (read+write states, grad, weight)
HBM_EFFICIENCY = (
    0.9  # memory-bound kernels stream at this share of the datasheet bandwidth (assumed)
)


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


@lru_cache(maxsize=65536)
def gemm_time(m: int, n: int, k: int, cluster: Cluster, dtype_bytes: int = 2) -> float:
    """Seconds for one (m×k)·(k×n) GEMM: measured samples if the profile has them, else the slower
    of the sustained rate cut by wave quantization and each tile's prologue, and the three matrices'
    bytes over HBM."""
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
    util = _wave_utilization(m, n, gpu.sms) * k / (k + GEMM_K_OVERHEAD) if gpu.sms else 1.0
    compute = flops / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency * util)
    memory = dtype_bytes * (m * k + k * n + m * n) / (gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9)
    return max(compute, memory) + (KERNEL_LAUNCH_S if gpu.sms else 0.0)


def elementwise_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds of memory-bound kernels moving `nbytes` (counted by fourd.plan.block) at
    HBM_EFFICIENCY, or measured."""
    return nbytes / (cluster.gpu.elementwise_gbps or cluster.gpu.hbm_bw_gbps * HBM_EFFICIENCY) / 1e9


def optimizer_time(params: float, cluster: Cluster, dtype_bytes: int = 2) -> float:
    """Seconds of an Adam update of `params` parameters: ADAM_BYTES each at HBM bandwidth, or
    measured."""
    rate = cluster.gpu.optimizer_gbps or cluster.gpu.hbm_bw_gbps * HBM_EFFICIENCY
    return params * ADAM_BYTES[dtype_bytes] / (rate * 1e9)


def attention_time(
    q_tokens: int, kv_len: int, heads: int, head_dim: int, cluster: Cluster, causal: bool = True
) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention, q_tokens queries per head against kv_len keys
    (causal: half the pairs; measured rates win, non-causal ones there from the explicit-mask
    kernel)."""
    gpu = cluster.gpu
    pairs = q_tokens * kv_len * (0.5 if causal else 1.0)
    fwd_flops = 4.0 * pairs * head_dim * heads
    if gpu.attention:
        masked = not causal and all(
            s.masked_fwd_tflops and s.masked_bwd_tflops for s in gpu.attention
        )
        rate = [
            _interpolate(
                [
                    ((s.seq, s.head_dim), float(getattr(s, ("masked_" * masked) + name) or 0))
                    for s in gpu.attention
                ],
                (kv_len, head_dim),
            )
            * 1e12
            for name in ("fwd_tflops", "bwd_tflops")
        ]
        return fwd_flops / rate[0], fwd_flops * FA_BACKWARD_FLOPS / rate[1]
    if gpu.attention_fwd_efficiency is None:
        # No fused-kernel figure: two batched matmuls, at the measured GEMM rate.
        per_head = gemm_time(q_tokens, kv_len, head_dim, cluster) * 2 * (0.5 if causal else 1.0)
        return per_head * heads, per_head * heads * FA_BACKWARD_FLOPS
    peak = gpu.peak_tflops * 1e12 * kv_len / (kv_len + FA_HALF_LENGTH)
    bwd_eff = gpu.attention_bwd_efficiency or gpu.attention_fwd_efficiency
    return fwd_flops / (peak * gpu.attention_fwd_efficiency), fwd_flops * FA_BACKWARD_FLOPS / (
        peak * bwd_eff
    )


# ---- collectives: nccl-tests conventions, the one table of fourd ---------------------------------

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
