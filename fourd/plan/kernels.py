"""One kernel's time: GEMMs, attention, memory-bound work, the optimizer update, collectives.
Seconds, bytes, FLOP/s; a profile's measured samples (`fourd calibrate`) win over the models;
docs/planner.md sources each figure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from fourd.comm import bus_factor
from fourd.plan.cluster import GPU, Cluster, Group, collective_latency, group_bandwidth

KERNEL_LAUNCH_S = 4e-6  # CUDA kernel launch and tail, per GEMM on a GPU
GPU_TILES = (
    (128, 128),
    (128, 256),
    (256, 128),
)  # output tiles cuBLAS picks among for large BF16 GEMMs
GEMM_K_OVERHEAD = (
    358  # a tile's prologue and epilogue, in units of the inner dimension k: rate · k / (k + this)
)
FA_BACKWARD_FLOPS = (
    2.5  # FlashAttention's backward redoes QK^T: 5 matmuls to the forward's 2 (Dao 2023 §3.1)
)
FA_HALF_LENGTH = 384  # attention kernels lose efficiency on short sequences: eff · L/(L+384)
# Each fused attention family's rate at head dim 64 over its rate at head dim 128, (forward, backward):
# Shah et al. 2024 (FlashAttention-3), Fig. 5-6, H100 SXM, 16k tokens, causal forward and the backward
# charts: FlashAttention-2 299/335 and 291/322 TFLOP/s, cuDNN 388/539 and 433/516
HEAD_DIM_64_SHARE = {
    "flash2": (299 / 335, 291 / 322),
    "cudnn": (388 / 539, 433 / 516),
}
# FlashAttention (Dao et al. 2022) at half FlashAttention-2's rates: "FlashAttention-2 ... yields around 2x
# speedup compared to FlashAttention, reaching 50-73% of the theoretical maximum FLOPs/s on A100", where
# FlashAttention reaches "only 25-40%" (Dao 2023, abstract and §1)
FLASH1_SHARE = 0.5
# FlashAttention in Triton (the Triton port of FlashAttention that llm-foundry runs as attn_impl triton)
# at (forward, backward) shares of FlashAttention-2's rates: "FlashAttention-2 is around 1.3-1.5x faster
# than FlashAttention in Triton in the forward pass and around 2x faster in the backward pass" (Dao 2023,
# §4.1, A100 80GB SXM4; the forward's 1.4x midway)
TRITON_SHARE = (1 / 1.4, 1 / 2)
# The fused attention families that run at a share of FlashAttention-2's rates: (forward, backward)
FAMILY_SHARES = {"flash1": (FLASH1_SHARE, FLASH1_SHARE), "triton": TRITON_SHARE}
ADAM_BYTES = {
    2: 30,
    4: 32,
}  # HBM bytes per owned parameter in an Adam update (read+write states, grad, weight)
HBM_EFFICIENCY = (
    0.9  # memory-bound kernels stream at this share of the datasheet bandwidth (assumed)
)


def _wave_utilization(rows: int, cols: int, sms: int) -> float:
    """Fraction of the SMs doing useful work when an m×n output is cut into tiles run in waves: the
    output's share of the tiles of all the waves, for the best tile."""
    return max(
        rows
        * cols
        / (
            tile_rows
            * tile_cols
            * sms
            * math.ceil(math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols) / sms)
        )
        for tile_rows, tile_cols in GPU_TILES
    )


def _interpolate(samples: Sequence[tuple[Sequence[float], float]], point: Sequence[float]) -> float:
    """A measured value at `point`: inverse-distance weighting (power 4) in log2 coordinates clamped
    to the samples' range; samples at the point itself are averaged."""
    logs = [tuple(math.log2(coord) for coord in where) for where, _ in samples]
    clamped = [
        min(max(math.log2(coord), min(bounds)), max(bounds))
        for coord, bounds in zip(point, zip(*logs))
    ]
    hits, weights, total = [], 0.0, 0.0
    for where, (_, value) in zip(logs, samples):
        squared_distance = sum((here - there) ** 2 for here, there in zip(where, clamped))
        if squared_distance < 1e-12:
            hits.append(value)
        elif not hits:
            weight = 1.0 / (squared_distance * squared_distance)
            weights, total = weights + weight, total + weight * value
    return sum(hits) / len(hits) if hits else total / weights


@lru_cache(maxsize=65536)
def gemm_time(
    m: int,
    n: int,
    k: int,
    cluster: Cluster,
    dtype_bytes: int = 2,
    fp8: bool = False,
    split_accumulator: bool = False,
) -> float:
    """Seconds for one (m×k)·(k×n) GEMM: measured samples if the profile has them, else the slower
    of the sustained rate cut by wave quantization and each tile's prologue, and the three matrices'
    bytes over HBM. `fp8`: FP8 inputs and a BF16 output, accumulated in split steps where
    `split_accumulator` (fp8_gemm_time)."""
    if fp8:
        return fp8_gemm_time(m, n, k, cluster, split_accumulator)
    gpu = cluster.gpu
    flops = 2.0 * m * n * k
    if gpu.gemm_shapes:
        return flops / (
            _interpolate(
                [((sample.m, sample.n, sample.k), sample.tflops) for sample in gpu.gemm_shapes],
                (m, n, k),
            )
            * 1e12
        )
    if gpu.gemm:
        return flops / (
            _interpolate(
                [((2 * sample.m * sample.n * sample.k,), sample.tflops) for sample in gpu.gemm],
                (flops,),
            )
            * 1e12
        )
    util = _wave_utilization(m, n, gpu.sms) * k / (k + GEMM_K_OVERHEAD) if gpu.sms else 1.0
    compute = flops / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency * util)
    memory = dtype_bytes * (m * k + k * n + m * n) / (gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9)
    return max(compute, memory) + (KERNEL_LAUNCH_S if gpu.sms else 0.0)


def fp8_gemm_time(
    m: int, n: int, k: int, cluster: Cluster, split_accumulator: bool = False
) -> float:
    """Seconds for one (m×k)·(k×n) GEMM of FP8 inputs with a BF16 output, as Transformer Engine
    runs the linear layers of FP8 training (Hopper's FP8 tensor cores):

        compute = 2·m·n·k / (fp8_peak · efficiency · share · waves · k/(k + K_OVERHEAD · r))
        memory  = (m·k + k·n + 2·m·n) bytes / HBM rate,    the slower of the two,

    r = fp8_peak / peak. The BF16 efficiency and tiles carry over (no FP8 GEMM is in the fit
    rows). Transformer Engine accumulates the forward's FP8 GEMMs fast and the backward's (input
    and weight gradients) in split steps promoted to FP32 (`_2X_ACC_FPROP = False`,
    `_2X_ACC_DGRAD` and `_2X_ACC_WGRAD = True`: transformer_engine/pytorch/module/base.py, v1.8
    to 2.x; the recipes' `fp8_gemm_fprop/dgrad/wgrad`), as torch._scaled_mm does by default.
    share is 1 for the first and the GPU's fp8_gemm_share for the second: FP8's measured share of
    its peak over BF16's of its own (Bekman's maximum achievable matmul rates, torch._scaled_mm:
    H100 SXM 1,402.6 of 1,979 TFLOP/s in FP8, 794.5 of 989 in BF16, 0.882). A tile's prologue
    and epilogue take the time they take in BF16, worth r times as many steps of k at the FP8
    rate. The peak is the datasheet's (H100 SXM: 1,979 dense TFLOP/s, twice BF16's). Measured
    samples are BF16 GEMMs and do not serve."""
    gpu = cluster.gpu
    if not gpu.fp8_peak_tflops or not gpu.sms:
        raise ValueError(f"{gpu.name} has no FP8 tensor cores in its profile")
    flops = 2.0 * m * n * k
    faster = gpu.fp8_peak_tflops / gpu.peak_tflops
    util = _wave_utilization(m, n, gpu.sms) * k / (k + GEMM_K_OVERHEAD * faster)
    share = gpu.fp8_gemm_share if split_accumulator else 1.0
    compute = flops / (gpu.fp8_peak_tflops * 1e12 * gpu.gemm_efficiency * share * util)
    memory = (m * k + k * n + 2 * m * n) / (gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9)
    return max(compute, memory) + KERNEL_LAUNCH_S


def elementwise_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds of memory-bound kernels moving `nbytes` (counted by fourd.plan.block) at
    HBM_EFFICIENCY, or measured."""
    return nbytes / (cluster.gpu.elementwise_gbps or cluster.gpu.hbm_bw_gbps * HBM_EFFICIENCY) / 1e9


def optimizer_time(params: float, cluster: Cluster, dtype_bytes: int) -> float:
    """Seconds of an Adam update of `params` parameters: ADAM_BYTES each at HBM bandwidth, or
    measured."""
    rate = cluster.gpu.optimizer_gbps or cluster.gpu.hbm_bw_gbps * HBM_EFFICIENCY
    return params * ADAM_BYTES[dtype_bytes] / (rate * 1e9)


def attention_time(
    q_tokens: int,
    kv_len: int,
    heads: int,
    head_dim: int,
    cluster: Cluster,
    causal: bool = True,
    kernel: str = "flash2",
) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention, q_tokens queries per head against kv_len keys
    (causal: half the pairs; measured rates win, non-causal ones there from the explicit-mask
    kernel). Without measured rates: FLOPs at peak · efficiency · L/(L + FA_HALF_LENGTH), the
    efficiencies of the kernel family `kernel` at `head_dim` ("cudnn": cuDNN's fused attention where
    the profile has its figures, else FlashAttention-2's)."""
    gpu = cluster.gpu
    pairs = q_tokens * kv_len * (0.5 if causal else 1.0)
    fwd_flops = 4.0 * pairs * head_dim * heads
    if gpu.attention:
        masked = not causal and all(
            sample.masked_fwd_tflops and sample.masked_bwd_tflops for sample in gpu.attention
        )
        prefix = ""
        if masked:  # the explicit-mask kernel's measured rates
            prefix = "masked_"
        rate = [
            _interpolate(
                [
                    ((sample.seq, sample.head_dim), float(getattr(sample, prefix + name) or 0))
                    for sample in gpu.attention
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
    fwd_eff, bwd_eff = attention_efficiencies(gpu, kernel, head_dim)
    peak = gpu.peak_tflops * 1e12 * kv_len / (kv_len + FA_HALF_LENGTH)
    return fwd_flops / (peak * fwd_eff), fwd_flops * FA_BACKWARD_FLOPS / (peak * bwd_eff)


def attention_efficiencies(gpu: GPU, kernel: str, head_dim: int = 128) -> tuple[float, float]:
    """(forward, backward) share of peak of the fused attention family `kernel` on long sequences
    with heads of `head_dim`: cuDNN's where asked for and the profile has them, else
    FlashAttention-2's (a backward figure missing: the forward's), FlashAttention's ("flash1") at
    FLASH1_SHARE of FlashAttention-2's, FlashAttention in Triton's ("triton") at TRITON_SHARE of
    them; times the family's head_dim_share (the profiles' figures are at head dim 128; the
    FlashAttention and Triton families taken as FlashAttention-2's)."""
    family = "flash2"
    forward, backward = gpu.attention_fwd_efficiency, gpu.attention_bwd_efficiency
    if kernel == "cudnn" and gpu.cudnn_attention_fwd_efficiency:
        family = "cudnn"
        forward, backward = gpu.cudnn_attention_fwd_efficiency, gpu.cudnn_attention_bwd_efficiency
    assert forward is not None  # the caller checked the profile has fused-attention figures
    # the (forward, backward) shares of FlashAttention-2's rates that the family runs at
    family_forward, family_backward = FAMILY_SHARES.get(kernel, (1.0, 1.0))
    forward_share, backward_share = head_dim_share(family, head_dim)
    return (
        forward * forward_share * family_forward,
        (backward or forward) * backward_share * family_backward,
    )


def head_dim_share(family: str, head_dim: int) -> tuple[float, float]:
    """(forward, backward) share of the kernel family's head-dim-128 rate that heads of `head_dim`
    run at: HEAD_DIM_64_SHARE at 64 and below, all of it at 128 and above, linear in log2(head_dim)
    between: smaller heads do less matmul work per score the softmax exponentiates (Shah et al. 2024,
    Fig. 5-6, measure 64 and 128 side by side on H100; the same shares are taken on every GPU)."""
    at_64 = HEAD_DIM_64_SHARE[family]
    toward_128 = min(max(math.log2(head_dim / 64), 0.0), 1.0)
    return (
        at_64[0] + (1.0 - at_64[0]) * toward_128,
        at_64[1] + (1.0 - at_64[1]) * toward_128,
    )


# ---- collectives: nccl-tests conventions, the one table of fourd ---------------------------------


@lru_cache(maxsize=65536)
def collective_time(op: str, nbytes: float, group: Group, cluster: Cluster) -> float:
    """Seconds for a collective on an nbytes buffer over `group` (nbytes: an all-gather's output, a
    reduce-scatter's input): its latency (`collective_latency`: NCCL's steps) and the bytes each rank
    sends, bus_factor(op, n) · nbytes, at the bus bandwidth the group's placement gives. A measured
    fit in the profile for this op and group size wins over the ring model."""
    ranks = group.size
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    for sample in cluster.collectives:
        if sample.op == op and sample.nproc == (
            2 if op == "send" else ranks
        ):  # a send pairs two ranks of any group
            share = cluster.core_share(group.world) / cluster.core_share(
                sample.nproc
            )  # measured with s.nproc busy
            return (sample.alpha_s + sample.beta_s_per_byte * nbytes) * share
    bus_bw, _ = group_bandwidth(
        group, cluster, 1 if op == "send" else None
    )  # a send: one NIC each end
    return collective_latency(op, group, cluster) + bus_factor(op, ranks) * nbytes / bus_bw
