"""The time model: GEMMs, attention, collectives, one pipeline stage's forward and backward, and a step.

Small pure functions, shared with the simulator (`fourd sim step` schedules these same per-microbatch
times), so that the two agree. Times are in seconds, sizes in bytes, rates in bytes/s or FLOP/s.
The signatures of `gemm_time`, `memory_time`, `collective_time`, `ring_bytes_per_rank`,
`stage_compute_time`, `chunk_times`, `p2p_time` and `step_time` are stable (new parameters come last,
with defaults).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from fourd.plan.cluster import Cluster, Group, group_bandwidth, placement, shard_group
from fourd.plan.memory import max_rank_params, rank_shapes, stage_layers

KERNEL_LAUNCH_S = 4e-6  # CUDA kernel launch and tail, per GEMM on a GPU
GPU_TILES = ((128, 128), (128, 256), (256, 128))  # output tiles cuBLAS picks among for large BF16 GEMMs
FA_BACKWARD_FLOPS = 2.5  # FlashAttention's backward redoes QK^T: 5 matmuls to the forward's 2 (Dao 2023 §3.1)
FA_HALF_LENGTH = 384  # attention kernels lose efficiency on short sequences: eff · L/(L+384)
OVERLAP_SLOWDOWN = 0.1  # compute slowdown while a collective runs beside it (SMs and HBM it takes)
ADAM_BYTES = {2: 30, 4: 32}  # HBM bytes per owned parameter in an Adam update (read+write states, grad, weight)


# ---- one kernel ---------------------------------------------------------------------------------------


def _wave_utilization(m: int, n: int, sms: int) -> float:
    """Fraction of the SMs doing useful work when an m×n output is cut into tiles and run in waves."""
    best = 0.0
    for tm, tn in GPU_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        useful = (m * n) / (math.ceil(m / tm) * tm * math.ceil(n / tn) * tn)
        best = max(best, useful * tiles / (waves * sms))
    return best


def _measured_tflops(samples, flops: float) -> float:
    """Linear interpolation of measured TFLOP/s in log(FLOPs), flat beyond the measured range."""
    pts = sorted((math.log(2 * s.m * s.n * s.k), s.tflops) for s in samples)
    x = math.log(flops)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return pts[-1][1]


def _interpolate(samples: list[tuple[tuple[float, ...], float]], point: tuple[float, ...]) -> float:
    """A measured value at `point` from samples at other points: inverse-distance weighting (power 4, so the
    nearest samples dominate) in log2 coordinates, each clamped to the samples' range (flat beyond them).
    Samples measured at the point itself are averaged."""
    logs = [tuple(math.log2(c) for c in where) for where, _ in samples]
    lo = [min(c) for c in zip(*logs)]
    hi = [max(c) for c in zip(*logs)]
    q = [min(max(math.log2(c), a), b) for c, a, b in zip(point, lo, hi)]
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
def gemm_time(m: int, n: int, k: int, cluster: Cluster) -> float:
    """Seconds for one (m×k)·(k×n) GEMM in the cluster's training precision.

    Measured samples (calibrate) win when the profile has them: those at training shapes, interpolated
    over (m, n, k), else the square ones, over FLOPs. Otherwise a roofline: FLOPs at the sustained GEMM
    rate, reduced by wave quantization of the output tiles over the SMs, or the bytes of the three
    matrices over HBM bandwidth, whichever is slower.
    """
    gpu = cluster.gpu
    flops = 2.0 * m * n * k
    if gpu.gemm_shapes:
        return flops / (_interpolate([((s.m, s.n, s.k), s.tflops) for s in gpu.gemm_shapes], (m, n, k)) * 1e12)
    if gpu.gemm:
        return flops / (_measured_tflops(gpu.gemm, flops) * 1e12)
    util = _wave_utilization(m, n, gpu.sms) if gpu.sms else 1.0
    compute = flops / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency * util)
    memory = cluster.dtype_bytes * (m * k + k * n + m * n) / (gpu.hbm_bw_gbps * 1e9)
    return max(compute, memory) + (KERNEL_LAUNCH_S if gpu.sms else 0.0)


def memory_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds to stream `nbytes` through HBM (elementwise kernels: norms, activations, residuals)."""
    return nbytes / (cluster.gpu.hbm_bw_gbps * 1e9)


def elementwise_time(nbytes: float, cluster: Cluster) -> float:
    """Seconds of a model's memory-bound kernels that move `nbytes` as fused kernels would. On GPUs they
    stream at HBM bandwidth; a CPU profile measures eager torch, one op and one pass at a time, and the
    rate it gives these same counted bytes (`elementwise_gbps`) wins."""
    rate = cluster.gpu.elementwise_gbps or cluster.gpu.hbm_bw_gbps
    return nbytes / (rate * 1e9)


def optimizer_time(params: float, cluster: Cluster) -> float:
    """Seconds of an Adam update of `params` parameters: ADAM_BYTES each at HBM bandwidth, or at the rate
    a CPU profile measured for torch's AdamW going parameter by parameter (`optimizer_gbps`)."""
    rate = cluster.gpu.optimizer_gbps or cluster.gpu.hbm_bw_gbps
    return params * ADAM_BYTES[cluster.dtype_bytes] / (rate * 1e9)


def attention_time(
    q_tokens: int, kv_len: int, heads: int, head_dim: int, cluster: Cluster, causal: bool = True
) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention for q_tokens queries per head against kv_len keys.

    Causal attention does half the score work; the backward does 2.5× the forward's FLOPs.
    """
    gpu = cluster.gpu
    pairs = q_tokens * kv_len * (0.5 if causal else 1.0)
    fwd_flops = 4.0 * pairs * head_dim * heads
    if gpu.attention:
        # CPU profiles: the rates measured for torch's attention at this sequence length and head size;
        # non-causal calls take the explicit-mask kernel, which computes every pair
        at = (kv_len, head_dim)
        masked = not causal and all(s.masked_fwd_tflops and s.masked_bwd_tflops for s in gpu.attention)
        fwd = (
            _interpolate(
                [
                    ((s.seq, s.head_dim), float(s.masked_fwd_tflops or 0) if masked else s.fwd_tflops)
                    for s in gpu.attention
                ],
                at,
            )
            * 1e12
        )
        bwd = (
            _interpolate(
                [
                    ((s.seq, s.head_dim), float(s.masked_bwd_tflops or 0) if masked else s.bwd_tflops)
                    for s in gpu.attention
                ],
                at,
            )
            * 1e12
        )
        return fwd_flops / fwd, fwd_flops * FA_BACKWARD_FLOPS / bwd
    if gpu.attention_fwd_efficiency is None:
        # No fused-kernel figure: two batched matmuls, at the measured GEMM rate.
        per_head = gemm_time(q_tokens, kv_len, head_dim, cluster) * 2 * (0.5 if causal else 1.0)
        return per_head * heads, per_head * heads * FA_BACKWARD_FLOPS
    length = kv_len / (kv_len + FA_HALF_LENGTH)
    peak = gpu.peak_tflops * 1e12 * length
    return (
        fwd_flops / (peak * gpu.attention_fwd_efficiency),
        fwd_flops * FA_BACKWARD_FLOPS / (peak * (gpu.attention_bwd_efficiency or gpu.attention_fwd_efficiency)),
    )


# ---- collectives --------------------------------------------------------------------------------------

# nccl-tests conventions (brief.md §5): bytes each rank sends = factor · nbytes; ring steps.
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
}
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "send": lambda n: 1,
}


def ring_bytes_per_rank(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring `op` on an nbytes buffer over n ranks (all-reduce: 2(n−1)/n·nbytes,
    the lower bound, Patarasuk & Yuan 2009)."""
    return _BUS_FACTOR[op](n) * nbytes if n > 1 else 0.0


@lru_cache(maxsize=65536)
def collective_time(op: str, nbytes: float, group: Group, cluster: Cluster) -> float:
    """Seconds for a collective on an nbytes buffer (the output of all-gather, the input of reduce-scatter,
    nccl-tests style) over `group`, at the bandwidth its placement gives. A measured fit in the profile
    for this op and group size wins over the ring model."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    for s in cluster.collectives:
        if s.op == op and s.nproc == n:
            return s.alpha_s + s.beta_s_per_byte * nbytes
    bw, latency = group_bandwidth(group, cluster)
    return _STEPS[op](n) * latency + ring_bytes_per_rank(op, nbytes, n) / bw


# ---- the model's work per microbatch -------------------------------------------------------------------


@dataclass(frozen=True)
class StageTime:
    """One microbatch through one pipeline stage (a run of consecutive layers) on one rank."""

    forward_s: float  # compute
    input_grad_s: float  # backward with respect to inputs (and any recomputation)
    weight_grad_s: float  # weight gradients (zero-bubble schedules defer these)
    forward_comm_s: float  # TP and CP collectives on the critical path
    backward_comm_s: float

    @property
    def forward(self) -> float:
        return self.forward_s + self.forward_comm_s

    @property
    def backward(self) -> float:
        return self.input_grad_s + self.weight_grad_s + self.backward_comm_s

    def __add__(self, other: StageTime) -> StageTime:
        return StageTime(*(a + b for a, b in zip(self._t(), other._t())))

    def scaled(self, k: float) -> StageTime:
        return StageTime(*(a * k for a in self._t()))

    def _t(self):
        return (self.forward_s, self.input_grad_s, self.weight_grad_s, self.forward_comm_s, self.backward_comm_s)


ZERO_TIME = StageTime(0.0, 0.0, 0.0, 0.0, 0.0)


def _gemms(model, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of the forward GEMMs of one layer on one TP rank (Megatron column/row split)."""
    hd = model.head_dim
    q_heads = model.heads // tp
    kv_heads = max(1, model.kv_heads // tp)
    up = 2 * model.ffn // tp if model.mlp == "swiglu" else model.ffn // tp
    return [
        (tokens, (q_heads + 2 * kv_heads) * hd, model.dim),  # fused QKV
        (tokens, model.dim, q_heads * hd),  # attention output
        (tokens, up, model.dim),  # w1 and w3 fused (fc1 for GeLU)
        (tokens, model.dim, model.ffn // tp),
    ]  # w2


def elementwise_bytes(model, tokens: int, tp: int, b: int, sequence_parallel: bool = True) -> tuple[float, float]:
    """HBM bytes of a layer's memory-bound kernels in forward: (norms and residuals, on the sequence-parallel
    shard or, without SP, on every token on every TP rank; RoPE and the MLP activation on the TP shard), and
    the part a selective recomputation redoes."""
    h, hd = model.dim, model.head_dim
    sp = tp if sequence_parallel else 1
    norms = 2 * 2 * h * b * tokens / sp  # two norms: read and write h
    residual = 2 * 3 * h * b * tokens / sp  # two adds: read 2h, write h
    rope = 2 * 2 * (model.heads + model.kv_heads) * hd * b * tokens / tp
    act = (3 if model.mlp == "swiglu" else 2) * model.ffn * b * tokens / tp
    return norms + residual + rope + act, norms + act


@lru_cache(maxsize=8192)
def layer_comm(
    model,
    cluster: Cluster,
    tp: int,
    cp: int,
    seq: int,
    micro_seqs: int,
    tp_group: Group,
    cp_group: Group,
    sequence_parallel: bool = True,
) -> tuple[float, float, float, float]:
    """(TP forward, TP backward, CP forward, CP backward) seconds of one layer's collectives, none overlapped.

    TP alone: an all-reduce after each of attention and MLP, forward and backward (Shoeybi et al. 2019
    §3). With sequence parallelism each all-reduce becomes an all-gather before the block and a
    reduce-scatter after it (Korthikanti et al. 2022 §4.2.2), and backward gathers the two saved input
    shards once more for the weight gradients. CP: all-gather K and V forward, again backward, and
    reduce-scatter their gradients (Llama 3 §3.3.2; with GQA these are small).
    """
    b = cluster.dtype_bytes
    act = micro_seqs * seq // cp * model.dim * b
    kv = 2 * max(1, model.kv_heads // tp) * model.head_dim * micro_seqs * seq * b
    kv_gather = collective_time("all_gather", kv, cp_group, cluster)
    cp_times = (kv_gather, kv_gather + collective_time("reduce_scatter", kv, cp_group, cluster))
    if not sequence_parallel:
        reduce = collective_time("all_reduce", act, tp_group, cluster)
        return (2 * reduce, 2 * reduce, *cp_times)
    gather = collective_time("all_gather", act, tp_group, cluster)
    scatter = collective_time("reduce_scatter", act, tp_group, cluster)
    return (2 * (gather + scatter), 4 * gather + 2 * scatter, *cp_times)


@lru_cache(maxsize=8192)
def layer_time(
    model,
    cluster: Cluster,
    tp: int,
    cp: int,
    seq: int,
    micro_seqs: int,
    recompute: str,
    tp_group: Group,
    cp_group: Group,
    sequence_parallel: bool = True,
) -> StageTime:
    """One transformer layer, one microbatch of micro_seqs sequences, on one rank of a (tp, cp) group."""
    b = cluster.dtype_bytes
    tokens = micro_seqs * seq // cp
    fwd = wgrad = dgrad = 0.0
    for m, n, k in _gemms(model, tokens, tp):
        fwd += gemm_time(m, n, k, cluster)
        dgrad += gemm_time(m, k, n, cluster)
        wgrad += gemm_time(k, n, m, cluster)
    # Each CP rank holds chunks i and 2·CP−1−i of every sequence, so its queries see on average half the
    # sequence and the causal work is even across ranks (Llama 3 §3.3.2): tokens·seq/2 score pairs.
    # A CPU profile's measured attention is torch's: there the chunks take an explicit mask, whose kernel
    # computes all tokens·seq pairs.
    all_pairs = cp > 1 and bool(cluster.gpu.attention)
    a_fwd, a_bwd = attention_time(tokens, seq, model.heads // tp, model.head_dim, cluster, causal=not all_pairs)
    ew, ew_selective = elementwise_bytes(model, tokens, tp, b, sequence_parallel)
    fwd += a_fwd + elementwise_time(ew, cluster)
    dgrad += a_bwd + elementwise_time(2 * ew, cluster)
    tp_f, tp_b, cp_f, cp_b = layer_comm(model, cluster, tp, cp, seq, micro_seqs, tp_group, cp_group, sequence_parallel)
    fwd_comm, bwd_comm = tp_f + cp_f, tp_b + cp_b
    if recompute == "selective":
        dgrad += elementwise_time(ew_selective, cluster)
    elif recompute == "full":
        dgrad += fwd
        bwd_comm += fwd_comm
    return StageTime(fwd, dgrad, wgrad, fwd_comm, bwd_comm)


def _head_time(model, cluster: Cluster, tokens: int, tp: int, tp_group: Group, sequence_parallel: bool) -> StageTime:
    """Final norm, output projection (vocabulary split over TP) and cross-entropy in FP32."""
    b, v = cluster.dtype_bytes, model.vocab // tp
    norm = 4 * model.dim * b * tokens / (tp if sequence_parallel else 1)
    fwd = gemm_time(tokens, v, model.dim, cluster) + elementwise_time(norm, cluster)
    dgrad = gemm_time(tokens, model.dim, v, cluster)
    wgrad = gemm_time(model.dim, v, tokens, cluster)
    logits = 4 * tokens * v  # FP32: written, read by the softmax, its gradient written
    fwd += elementwise_time(2 * logits, cluster)
    dgrad += elementwise_time(2 * logits, cluster)
    act = tokens * model.dim * b
    # the vocabulary-parallel loss all-reduces max, sum and target logit; SP gathers the input first and
    # reduce-scatters its gradient, plain TP all-reduces the gradient
    loss = collective_time("all_reduce", 3 * 4 * tokens, tp_group, cluster)
    if not sequence_parallel:
        return StageTime(fwd, dgrad, wgrad, loss, collective_time("all_reduce", act, tp_group, cluster))
    comm_f = collective_time("all_gather", act, tp_group, cluster) + loss
    return StageTime(fwd, dgrad, wgrad, comm_f, collective_time("reduce_scatter", act, tp_group, cluster))


def _embedding_time(
    model, cluster: Cluster, tokens: int, tp: int, tp_group: Group, sequence_parallel: bool
) -> StageTime:
    """Vocabulary-parallel lookup: partial rows, reduce-scattered into the sequence-parallel shard (or
    all-reduced without SP)."""
    act = tokens * model.dim * cluster.dtype_bytes
    if not sequence_parallel:
        return StageTime(
            elementwise_time(act, cluster),
            elementwise_time(2 * act, cluster),
            0.0,
            collective_time("all_reduce", act, tp_group, cluster),
            0.0,
        )
    return StageTime(
        elementwise_time(act, cluster),
        elementwise_time(2 * act, cluster),
        0.0,
        collective_time("reduce_scatter", act, tp_group, cluster),
        collective_time("all_gather", act, tp_group, cluster),
    )


def compute_share(layout, cluster: Cluster) -> float:
    """How much slower each rank computes because ranks of one server share its compute (CPU profiles).

    Ranks beyond `concurrent_ranks` (the cores) take turns; and the cores in use share memory bandwidth
    and clocks, so together they reach the profile's all-core peak, not each its one-worker best (on this
    kind of machine 92 GFLOP/s on two cores against 54 on one, brief.md §6).
    """
    slots = cluster.node.concurrent_ranks
    if not slots:
        return 1.0
    per_node = min(layout.tp * layout.cp * layout.pp * layout.dp, cluster.node.gpus)
    gpu = cluster.gpu
    one = max(s.tflops for s in gpu.gemm) if gpu.gemm else gpu.peak_tflops / slots
    busy = min(per_node, slots)
    return max(1.0, per_node / slots) * max(1.0, busy * one / gpu.peak_tflops)


def stage_compute_time(
    model,
    cluster: Cluster,
    layout,
    seq: int,
    micro_seqs: int,
    layers: int,
    *,
    first: bool = False,
    last: bool = False,
    recompute: str = "none",
    sequence_parallel: bool = True,
) -> StageTime:
    """One microbatch of `micro_seqs` sequences of `seq` tokens through a pipeline stage of `layers` layers
    (plus the embedding if `first`, the output and loss if `last`) on one GPU of `layout`; TP and CP
    collectives included as exposed communication."""
    groups = placement(layout, cluster)
    tokens = micro_seqs * seq // layout.cp
    sp = sequence_parallel
    t = layer_time(
        model, cluster, layout.tp, layout.cp, seq, micro_seqs, recompute, groups["tp"], groups["cp"], sp
    ).scaled(layers)
    if first:
        t = t + _embedding_time(model, cluster, tokens, layout.tp, groups["tp"], sp)
    if last:
        t = t + _head_time(model, cluster, tokens, layout.tp, groups["tp"], sp)
    k = compute_share(layout, cluster)
    return StageTime(t.forward_s * k, t.input_grad_s * k, t.weight_grad_s * k, t.forward_comm_s, t.backward_comm_s)


def chunk_times(
    model,
    cluster: Cluster,
    layout,
    seq: int,
    micro_seqs: int,
    virtual_stages: int = 1,
    recompute: str = "none",
    sequence_parallel: bool = True,
) -> list[StageTime]:
    """StageTime of each global pipeline stage 0 .. pp·V−1 in model order (stage s runs on rank s % pp)."""
    counts = stage_layers(model.layers, layout.pp, virtual_stages)
    last = len(counts) - 1
    return [
        stage_compute_time(
            model,
            cluster,
            layout,
            seq,
            micro_seqs,
            n,
            first=(s == 0),
            last=(s == last),
            recompute=recompute,
            sequence_parallel=sequence_parallel,
        )
        for s, n in enumerate(counts)
    ]


@lru_cache(maxsize=16384)
def slowest_rank(
    model,
    cluster: Cluster,
    layout,
    seq: int,
    micro_seqs: int,
    virtual_stages: int,
    recompute: str,
    sequence_parallel: bool = True,
) -> tuple[int, StageTime]:
    """The pipeline rank with the most work per microbatch, and that work (all its stages). Rank 0 also
    embeds and rank pp−1 also runs the output and the loss."""
    per_rank = rank_shapes(model, layout.pp, virtual_stages)[0]
    p = layout.pp
    # ranks with equal layers and no embedding or head take equal time: look at one of each kind
    seen: dict[int, int] = {}
    for r in range(1, p - 1):
        seen.setdefault(per_rank[r], r)
    candidates = {0, p - 1, *seen.values()}
    times = {
        r: stage_compute_time(
            model,
            cluster,
            layout,
            seq,
            micro_seqs,
            per_rank[r],
            first=(r == 0),
            last=(r == p - 1),
            recompute=recompute,
            sequence_parallel=sequence_parallel,
        )
        for r in candidates
    }
    r = max(times, key=lambda r: times[r].forward + times[r].backward)
    return r, times[r]


def p2p_time(model, cluster: Cluster, layout, seq: int, micro_seqs: int, sequence_parallel: bool = True) -> float:
    """One activation (or its gradient) sent between adjacent pipeline ranks; with SP each TP rank sends
    its shard, without it the whole activation."""
    nbytes = micro_seqs * seq // layout.cp * model.dim * cluster.dtype_bytes / (layout.tp if sequence_parallel else 1)
    world = layout.tp * layout.cp * layout.pp * layout.dp
    return collective_time("send", nbytes, Group(2, layout.tp * layout.cp, world), cluster)


# ---- one optimizer step ----------------------------------------------------------------------------------


def bubble_time(schedule: str, pp: int, microbatches: int, virtual_stages: int, stage: StageTime) -> float:
    """Idle time of a pipeline rank per step, for per-microbatch times `stage` (all its layers).

    GPipe and 1F1B: (p−1)·(t_f + t_b), an idle fraction (p−1)/(m+p−1) of the step (Huang et al. 2019;
    Narayanan et al. 2021 §2.2). Interleaved with V stages per rank: (p−1)/V·(t_f + t_b), i.e. (p−1)/(V·m)
    of compute (Narayanan et al. 2021 §2.2.1). Zero-bubble ZB-H1: (p−1)·(t_f + t_i − t_w), weight-gradient
    work filling the cool-down (Qi et al. 2023 §3.1).
    """
    p, v = pp, virtual_stages
    whole = stage.forward + stage.backward
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * whole
    if schedule == "interleaved":
        return (p - 1) / v * whole
    if schedule == "zero-bubble":
        return (p - 1) * max(0.0, stage.forward + stage.input_grad_s + stage.backward_comm_s - stage.weight_grad_s)
    raise ValueError(f"unknown schedule {schedule!r}")


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of the step with equal stages and free communication: (p−1)/(m+p−1) for GPipe and 1F1B
    (p = 16: 48.4 % at m = 16, 19.0 % at 64, 10.5 % at 128); interleaved (p−1)/(V·m+p−1), the bubble
    (p−1)/(V·m) of compute as a share of the step."""
    p, m, v = pp, microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


@dataclass(frozen=True)
class StepTime:
    step_s: float
    compute_s: float  # m · (t_f + t_b) of the slowest pipeline rank, TP/CP communication included
    bubble_s: float
    p2p_s: float  # pipeline sends on the critical path (warm-up and cool-down)
    dp_exposed_s: float  # data-parallel collectives not hidden behind compute
    dp_total_s: float  # all data-parallel collectives of the step
    overlap_s: float  # compute slowed by collectives running beside it
    optimizer_s: float
    tp_comm_s: float  # part of compute_s
    cp_comm_s: float  # part of compute_s
    slowest_rank: int
    per_microbatch: StageTime  # the slowest pipeline rank, all its stages


def _dp_exposure(
    zero: int, m: int, nbytes: float, group: Group, cluster: Cluster, t: StageTime, bubble: float, layers: int
) -> tuple[float, float]:
    """(exposed, total) seconds of ZeRO/DDP traffic on `nbytes` of weights (and as many of gradients).

    Gradients of a layer are reduced as soon as its last backward ends, weights gathered just before their
    first use (bucketed by layer, as DDP and FSDP do): what does not fit in the compute around it, and the
    last bucket, stay on the critical path. Stage 0 all-reduces; 1 reduce-scatters gradients once per step
    and all-gathers the updated weights; 2 reduce-scatters every microbatch (gradients stay sharded);
    3 also gathers weights for every microbatch's forward and backward (Rajbhandari et al. 2020).
    """

    def ct(op):
        return collective_time(op, nbytes, group, cluster)

    tail = t.backward + bubble / 2  # the last microbatch's backward and the cool-down
    head = t.forward + bubble / 2  # the first microbatch's forward and the warm-up
    if zero == 0:
        phases = [(ct("all_reduce"), tail, 1)]
    elif zero == 1:
        phases = [(ct("reduce_scatter"), tail, 1), (ct("all_gather"), head, 1)]
    elif zero == 2:
        phases = [(m * ct("reduce_scatter"), m * t.backward, m), (ct("all_gather"), head, 1)]
    else:
        phases = [
            (m * ct("all_gather"), m * t.forward, m),
            (m * (ct("all_gather") + ct("reduce_scatter")), m * t.backward, m),
        ]
    total = sum(c for c, _, _ in phases)
    exposed = sum(max(0.0, c - window) + c / (max(1, layers) * n) for c, window, n in phases)
    return min(exposed, total), total


@lru_cache(maxsize=16384)
def _pipeline_work(
    model,
    cluster: Cluster,
    layout,
    seq: int,
    micro_seqs: int,
    virtual_stages: int,
    recompute: str,
    sequence_parallel: bool,
):
    """What a step's time needs that does not depend on the schedule or the ZeRO stage."""
    p, sp = layout.pp, sequence_parallel
    slow, t = slowest_rank(model, cluster, layout, seq, micro_seqs, virtual_stages, recompute, sp)
    p2p = 2 * (p - 1) * p2p_time(model, cluster, layout, seq, micro_seqs, sp) if p > 1 else 0.0
    params = max_rank_params(model, p, virtual_stages, layout.tp)
    layers = rank_shapes(model, p, virtual_stages)[0][slow]
    groups = placement(layout, cluster)
    tp_f, tp_b, cp_f, cp_b = layer_comm(
        model, cluster, layout.tp, layout.cp, seq, micro_seqs, groups["tp"], groups["cp"], sp
    )
    redo = 2 if recompute == "full" else 1
    return (
        slow,
        t,
        p2p,
        params,
        layers,
        shard_group(layout),
        layers * (tp_f * redo + tp_b),
        layers * (cp_f * redo + cp_b),
    )


def step_time(
    model,
    cluster: Cluster,
    layout,
    seq: int,
    global_seqs: int,
    schedule: str,
    microbatches: int,
    virtual_stages: int = 1,
    zero: int = 1,
    recompute: str = "none",
    sequence_parallel: bool = True,
) -> StepTime:
    """Seconds per optimizer step of `global_seqs` sequences of `seq` tokens, and where they go."""
    p, v, m = layout.pp, virtual_stages, microbatches
    micro = global_seqs // (layout.dp * m)
    slow, t, p2p, params, layers, shard, tp_comm, cp_comm = _pipeline_work(
        model, cluster, layout, seq, micro, v, recompute, sequence_parallel
    )
    compute = m * (t.forward + t.backward)
    bubble = bubble_time(schedule, p, m, v, t) if p > 1 else 0.0
    exposed, total = _dp_exposure(zero, m, params * cluster.dtype_bytes, shard, cluster, t, bubble, layers)
    if cluster.node.concurrent_ranks:
        # CPU profiles: a collective's copies, reductions and socket work run on the cores the compute
        # needs, so nothing hides behind compute
        exposed = total
    overlap = OVERLAP_SLOWDOWN * (total - exposed)
    owned = params / (shard.size if zero >= 1 else 1)
    optimizer = optimizer_time(owned, cluster)
    step = compute + bubble + p2p + exposed + overlap + optimizer
    return StepTime(step, compute, bubble, p2p, exposed, total, overlap, optimizer, m * tp_comm, m * cp_comm, slow, t)


# ---- whole-run arithmetic (brief.md §1, rows 01-02) ---------------------------------------------------------

SECONDS_PER_YEAR = 365.25 * 86400


def training_flops(params: float, tokens: float) -> float:
    """6·N·D (Kaplan et al. 2020): 405e9 parameters × 15.6e12 tokens ≈ 3.8e25 FLOPs."""
    return 6.0 * params * tokens


def gpu_years(flops: float, flops_per_gpu: float) -> float:
    """One GPU at a sustained rate: 3.8e25 FLOPs at 400 TFLOP/s ≈ 3,000 years."""
    return flops / flops_per_gpu / SECONDS_PER_YEAR


def run_days(flops: float, gpus: int, flops_per_gpu: float) -> float:
    """Days on `gpus` GPUs at a sustained rate: 3.8e25 FLOPs on 16,384 GPUs at 400 TFLOP/s ≈ 67 days."""
    return flops / (gpus * flops_per_gpu) / 86400
