"""The time of a step: a layer's work and collectives, a pipeline stage, the schedule's bubble,
data-parallel traffic, the optimizer. `fourd sim step` schedules these same per-microbatch times.
Seconds, bytes, FLOP/s."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from fourd.plan.block import loss_bytes, matmuls, traffic
from fourd.plan.cluster import Cluster, Group, placement, replica_group, shard_group
from fourd.plan.job import Job, Work, stage_layers
from fourd.plan.kernels import (
    attention_time,
    collective_time,
    elementwise_time,
    gemm_time,
    optimizer_time,
)
from fourd.plan.memory import max_rank_params, rank_shapes

OVERLAP_SLOWDOWN = 0.1  # compute slowdown while a collective runs beside it (SMs and HBM it takes)
GRAD_ACCUMULATE_BYTES = 10  # per parameter: the BF16 gradient read, the FP32 sum read and written
# Fitted (benchmarks/validate_planner.py --fit): the standard deviation of one rank's step time from
# host stalls (Python, the garbage collector, the launch queue), seconds; a step waits for the
# slowest rank
STRAGGLER_JITTER_S = 0.04815


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """One microbatch through one pipeline stage (a run of consecutive layers) on one rank."""

    forward_s: float  # compute
    input_grad_s: float  # backward with respect to inputs (and any recomputation)
    weight_grad_s: float  # weight gradients (zero-bubble schedules defer these)
    forward_comm_s: float  # TP and CP collectives on the critical path
    backward_comm_s: float

    forward = property(lambda self: self.forward_s + self.forward_comm_s)
    backward = property(lambda self: self.input_grad_s + self.weight_grad_s + self.backward_comm_s)

    def __add__(self, other: StageTime) -> StageTime:
        names = [f.name for f in fields(self)]
        return StageTime(**{n: getattr(self, n) + getattr(other, n) for n in names})

    def scaled(self, k: float, comm: float | None = None) -> StageTime:
        """Compute times k times, communication `comm` times (default k)."""
        comm_factor = k if comm is None else comm
        return StageTime(
            forward_s=self.forward_s * k,
            input_grad_s=self.input_grad_s * k,
            weight_grad_s=self.weight_grad_s * k,
            forward_comm_s=self.forward_comm_s * comm_factor,
            backward_comm_s=self.backward_comm_s * comm_factor,
        )


@lru_cache(maxsize=8192)
def layer_gemms(work: Work) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one layer's linear-layer GEMMs on one
    rank: each forward (tokens × k)·(k × n), its input gradient (tokens × n)·(n × k), its weight
    gradient (k × tokens)·(tokens × n); `per-op` recomputation redoes every other forward GEMM in
    backward.
    """
    cluster, dtype_bytes, tokens = work.cluster, work.dtype_bytes, work.tokens
    launch = work.stack.launch_s
    forward = input_grad = weight_grad = 0.0
    for index, (n, k) in enumerate(matmuls(work)):
        forward += gemm_time(tokens, n, k, cluster, dtype_bytes, launch)
        input_grad += gemm_time(tokens, k, n, cluster, dtype_bytes, launch)
        weight_grad += gemm_time(k, n, tokens, cluster, dtype_bytes, launch)
        if index % 2 and work.recompute == "per-op":
            input_grad += gemm_time(tokens, n, k, cluster, dtype_bytes, launch)
    return forward, input_grad, weight_grad


def ring_exposed(comm_s: float, gemm_s: float, tp: int) -> float:
    """Seconds of a TP collective left on the critical path when a ring overlaps it with its GEMM
    (Transformer Engine's userbuffers, torch's async TP): the GEMM is cut into tp chunks and each
    chunk's exchange runs beside the previous chunk's GEMM, so the first (or last) chunk's share
    stays exposed, and whatever the GEMM is too short to cover:

        exposed = max(comm / tp, comm − gemm · (tp − 1) / tp)"""
    return max(comm_s / tp, comm_s - gemm_s * (tp - 1) / tp)


@lru_cache(maxsize=8192)
def layer_comm(work: Work) -> tuple[float, float, float, float]:
    """(TP forward, TP backward, CP forward, CP backward) seconds of one layer's collectives on the
    critical path (docs/planner.md: Shoeybi et al. 2019, Korthikanti et al. 2022 §4.2.2 with SP,
    Llama 3 §3.3.2 for CP). With SP the forward all-gathers twice and reduce-scatters twice, the
    backward gathers four times (the inputs again) and reduce-scatters twice; without SP each way
    all-reduces twice. A stack whose TP overlaps by ring (SP only, as TE's userbuffers require)
    leaves `ring_exposed` of it."""
    model, cluster, lay, dtype_bytes = work.model, work.cluster, work.layout, work.dtype_bytes
    groups = placement(lay)
    act = work.tokens * model.dim * dtype_bytes
    kv_heads = max(1, model.kv_heads // lay.tp)
    kv = 2 * kv_heads * model.head_dim * work.micro_seqs * work.seq * dtype_bytes
    kv_gather = collective_time("all_gather", kv, groups["cp"], cluster)
    kv_scatter = collective_time("reduce_scatter", kv, groups["cp"], cluster)
    tp = groups["tp"]
    if not work.sequence_parallel:
        reduce = collective_time("all_reduce", act, tp, cluster)
        return 2 * reduce, 2 * reduce, kv_gather, kv_gather + kv_scatter
    gather = collective_time("all_gather", act, tp, cluster)
    scatter = collective_time("reduce_scatter", act, tp, cluster)
    forward, backward = 2 * (gather + scatter), 4 * gather + 2 * scatter
    if work.stack.tp_overlap == "ring" and lay.tp > 1:
        gemm_fwd, gemm_dgrad, gemm_wgrad = layer_gemms(work)
        forward = ring_exposed(forward, gemm_fwd, lay.tp)
        backward = ring_exposed(backward, gemm_dgrad + gemm_wgrad, lay.tp)
    return forward, backward, kv_gather, kv_gather + kv_scatter


def tp_hidden(work: Work) -> float:
    """Seconds of TP communication per layer (forward and backward) that a ring overlap hides."""
    if work.stack.tp_overlap != "ring" or not work.sequence_parallel or work.layout.tp <= 1:
        return 0.0
    plain = replace(work, stack=replace(work.stack, tp_overlap="none"))
    exposed_fwd, exposed_bwd, _, _ = layer_comm(work)
    full_fwd, full_bwd, _, _ = layer_comm(plain)
    return full_fwd + full_bwd - exposed_fwd - exposed_bwd


def materialized_attention(work: Work) -> tuple[float, float]:
    """(forward, backward) seconds of attention that writes the s × s scores (Megatron's scale-mask-
    softmax): two batched GEMMs, softmax and dropout forward, four GEMMs and their backward
    (Korthikanti et al. 2022 §4). Forward: Q·Kᵀ, P·V and 9 bytes per score; backward: one score
    GEMM, three value-shaped GEMMs and 11."""
    model, cluster, dtype_bytes = work.model, work.cluster, work.dtype_bytes
    launch = work.stack.launch_s
    batch = work.micro_seqs * (model.heads // work.layout.tp)  # the GEMMs' batch, stacked into rows
    rows, keys, head_dim = batch * work.tokens // work.micro_seqs, work.seq, model.head_dim
    scores_s = gemm_time(rows, keys, head_dim, cluster, dtype_bytes, launch)
    values_s = gemm_time(rows, head_dim, keys, cluster, dtype_bytes, launch)
    scores = rows * keys
    forward = scores_s + values_s + elementwise_time(9 * scores, cluster)
    return forward, scores_s + 3 * values_s + elementwise_time(11 * scores, cluster)


def _attention(work: Work) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core."""
    if work.attention == "materialized":
        return materialized_attention(work)
    # CP ranks hold chunks i and 2·CP−1−i: causal, tokens·seq/2 pairs (Llama 3 §3.3.2); on a CPU
    # profile the chunks take torch's explicit-mask kernel, which computes all pairs
    all_pairs = work.layout.cp > 1 and bool(work.cluster.gpu.attention)
    model, tp = work.model, work.layout.tp
    return attention_time(
        work.tokens,
        work.seq,
        model.heads // tp,
        model.head_dim,
        work.cluster,
        causal=not all_pairs,
        kernel=work.stack.attention_kernel,
    )


@lru_cache(maxsize=8192)
def layer_time(work: Work) -> StageTime:
    """One transformer layer, one microbatch, on one rank of a (tp, cp) group: the GEMMs, attention,
    the memory-bound ops, the CPU time a CPU profile measured for fourd's TP and FSDP, TP and CP
    collectives (`layer_comm`), the compute that a ring-overlapped TP collective slows
    (OVERLAP_SLOWDOWN of what it hides), and what recomputation redoes."""
    cluster, tokens = work.cluster, work.tokens
    fwd, dgrad, wgrad = layer_gemms(work)
    attn_fwd, attn_bwd = _attention(work)
    counted = traffic(work)
    block_bytes_fwd = tokens * counted.forward
    block_bytes_bwd = tokens * (counted.backward + counted.redo)
    fwd += attn_fwd + elementwise_time(block_bytes_fwd, cluster, fused=work.compiled)
    dgrad += attn_bwd + elementwise_time(block_bytes_bwd, cluster, fused=work.compiled)
    # the CPU time a CPU profile measured fourd's TP (DTensor) and FSDP to add per layer, a third
    # forward
    cpu_us = 0.0
    if work.layout.tp > 1:
        cpu_us += cluster.gpu.tp_layer_us
    if work.fsdp:
        cpu_us += cluster.gpu.fsdp_layer_us
    fwd, dgrad = fwd + cpu_us * 1e-6 / 3, dgrad + cpu_us * 2e-6 / 3
    dgrad += OVERLAP_SLOWDOWN * tp_hidden(work)
    tp_fwd, tp_bwd, cp_fwd, cp_bwd = layer_comm(work)
    fwd_comm, bwd_comm = tp_fwd + cp_fwd, tp_bwd + cp_bwd
    if work.recompute == "full":
        dgrad += fwd
        bwd_comm += fwd_comm
    elif work.recompute == "selective" and work.attention == "materialized":
        dgrad += (
            attn_fwd  # the attention core, recomputed from Q, K and V (Korthikanti et al. 2022 §5)
        )
    return StageTime(
        forward_s=fwd,
        input_grad_s=dgrad,
        weight_grad_s=wgrad,
        forward_comm_s=fwd_comm,
        backward_comm_s=bwd_comm,
    )


def _head_time(work: Work, tp_group: Group) -> StageTime:
    """Final norm, output projection (vocabulary split over TP) and torch's cross-entropy on the
    logits."""
    cluster, tokens, tp, dtype_bytes = work.cluster, work.tokens, work.layout.tp, work.dtype_bytes
    dim, vocab, launch = work.model.dim, work.model.vocab // tp, work.stack.launch_s
    norm = 4.0 * dim * dtype_bytes * tokens
    if work.sequence_parallel:
        norm /= tp
    loss_fwd, loss_bwd, _ = loss_bytes(dtype_bytes)
    fwd = gemm_time(tokens, vocab, dim, cluster, dtype_bytes, launch)
    # torch's (or Megatron's vocabulary-parallel) cross-entropy runs eager, one kernel per op
    fwd += elementwise_time(norm + loss_fwd * tokens * vocab, cluster, fused=False)
    dgrad = gemm_time(tokens, dim, vocab, cluster, dtype_bytes, launch)
    dgrad += elementwise_time(2 * norm + loss_bwd * tokens * vocab, cluster, fused=False)
    wgrad = gemm_time(dim, vocab, tokens, cluster, dtype_bytes, launch)
    act = tokens * dim * dtype_bytes
    # the vocabulary-parallel loss all-reduces max, sum and target logit; SP gathers the input first
    # and reduce-scatters its gradient, plain TP all-reduces the gradient
    loss = collective_time("all_reduce", 3 * 4 * tokens, tp_group, cluster)
    if work.sequence_parallel:
        comm_fwd = collective_time("all_gather", act, tp_group, cluster) + loss
        comm_bwd = collective_time("reduce_scatter", act, tp_group, cluster)
    else:
        comm_fwd, comm_bwd = loss, collective_time("all_reduce", act, tp_group, cluster)
    return StageTime(
        forward_s=fwd,
        input_grad_s=dgrad,
        weight_grad_s=wgrad,
        forward_comm_s=comm_fwd,
        backward_comm_s=comm_bwd,
    )


def compute_share(layout, cluster: Cluster) -> float:
    """How much slower each rank computes where ranks share a server's cores (CPU profiles): ranks
    beyond `concurrent_ranks` take turns, and the busy cores together reach the all-core peak."""
    slots = cluster.node.concurrent_ranks
    if not slots:
        return 1.0
    gpu, busy = cluster.gpu, min(layout.world, cluster.node.gpus, slots)
    one = max(s.tflops for s in gpu.gemm) if gpu.gemm else gpu.peak_tflops / slots
    return cluster.core_share(layout.world) * max(1.0, busy * one / gpu.peak_tflops)


def _embedding_time(work: Work, tp_group: Group) -> StageTime:
    """The vocabulary-parallel lookup: partial rows reduce-scattered into the SP shard (or all-
    reduced)."""
    cluster = work.cluster
    act = work.tokens * work.model.dim * work.dtype_bytes
    if work.sequence_parallel:
        comm_fwd = collective_time("reduce_scatter", act, tp_group, cluster)
        comm_bwd = collective_time("all_gather", act, tp_group, cluster)
    else:
        comm_fwd, comm_bwd = collective_time("all_reduce", act, tp_group, cluster), 0.0
    return StageTime(
        forward_s=elementwise_time(act, cluster, fused=False),
        input_grad_s=elementwise_time(2 * act, cluster, fused=False),
        weight_grad_s=0.0,
        forward_comm_s=comm_fwd,
        backward_comm_s=comm_bwd,
    )


@lru_cache(maxsize=16384)
def stage_time(work: Work, layers: int, first: bool = False, last: bool = False) -> StageTime:
    """One microbatch through a pipeline stage of `layers` layers (plus the embedding if `first`,
    the output and loss if `last`) on one GPU; TP and CP collectives included as exposed
    communication."""
    tp_group = placement(work.layout)["tp"]
    total = layer_time(work).scaled(layers)
    if first:
        total = total + _embedding_time(work, tp_group)
    if last:
        total = total + _head_time(work, tp_group)
    # collective_time counts the core share itself
    return total.scaled(compute_share(work.layout, work.cluster), comm=1.0)


def chunk_times(job: Job) -> list[StageTime]:
    """StageTime of each global pipeline stage 0 .. pp·V−1 in model order (stage s runs on rank s %
    pp)."""
    counts = stage_layers(job.model.layers, job.layout.pp, job.par.virtual_stages)
    last = len(counts) - 1
    return [stage_time(job.work, n, s == 0, s == last) for s, n in enumerate(counts)]


@lru_cache(maxsize=16384)
def slowest_rank(work: Work, p: int, virtual_stages: int) -> tuple[int, StageTime]:
    """The pipeline rank with the most work per microbatch (embedding and head included), and that
    work."""
    # equal layers, equal time: one rank of each kind
    per_rank, _, kinds = rank_shapes(work.model, p, virtual_stages)
    times = {r: stage_time(work, per_rank[r], r == 0, r == p - 1) for r in kinds}
    rank = max(times, key=lambda r: times[r].forward + times[r].backward)
    return rank, times[rank]


def p2p_time(job: Job) -> float:
    """One activation (or its gradient) sent between adjacent pipeline ranks, at the slowest
    boundary (where the pipeline spans servers some neighbours are on two). With SP each TP rank
    sends its shard; blocking (DeepSpeed's engine) partitions it over TP too and gathers it on
    arrival."""
    work, lay, groups = job.work, job.layout, placement(job.layout)
    full = work.tokens * work.model.dim * work.dtype_bytes
    if work.sequence_parallel:
        return collective_time("send", full / lay.tp, groups["pp"], job.cluster)
    if job.pipeline_comm == "blocking":
        send = collective_time("send", full / lay.tp, groups["pp"], job.cluster)
        return send + collective_time("all_gather", full, groups["tp"], job.cluster)
    return collective_time("send", full, groups["pp"], job.cluster)


def bubble_time(
    schedule: str, pp: int, microbatches: int, virtual_stages: int, stage: StageTime
) -> float:
    """Idle time of a pipeline rank per step for per-microbatch times `stage` (all its layers), the
    closed forms of fourd.schedules' lists (docs/simulators.md), with p = pp, m = microbatches, V =
    virtual stages, t_f and t_b the forward and backward (communication included), t_i the input-
    gradient part of the backward with its communication and t_w the weight-gradient part:

        GPipe, 1F1B:   (p − 1) · (t_f + t_b)
        interleaved:   ((p − 1) · V − (V − 1) · (min(m, p) − 1)) · (t_f + t_b) / V
                       which is (p − 1)/V · (t_f + t_b) for m ≥ p; with m < p each round of p
                       microbatches waits for microbatch 0 to come back
        ZB-H1:         (p − 1) · max(0, t_f + t_i − t_w)"""
    whole = stage.forward + stage.backward
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) * whole
    if schedule == "interleaved":
        rounds = (pp - 1) * virtual_stages - (virtual_stages - 1) * (min(microbatches, pp) - 1)
        return rounds * whole / virtual_stages
    input_grad = stage.input_grad_s + stage.backward_comm_s
    return (pp - 1) * max(0.0, stage.forward + input_grad - stage.weight_grad_s)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    step_s: float
    compute_s: float  # m · (t_f + t_b) of the slowest pipeline rank, TP/CP communication included
    bubble_s: float
    # pipeline sends on the critical path (warm-up and cool-down; blocking, every microbatch's)
    p2p_s: float
    dp_exposed_s: float  # data-parallel collectives not hidden behind compute
    dp_total_s: float  # all data-parallel collectives of the step
    overlap_s: float  # compute slowed by collectives running beside it
    optimizer_s: float
    straggler_s: float  # the slowest of the ranks' jitter, which every rank waits for
    tp_comm_s: float  # part of compute_s
    cp_comm_s: float  # part of compute_s
    slowest_rank: int
    per_microbatch: StageTime  # the slowest pipeline rank, all its stages


def _dp_phases(
    job: Job, stage: StageTime, bubble: float, layers: int
) -> list[tuple[float, float, int]]:
    """The slowest rank's ZeRO/DDP traffic as (seconds, compute window it hides behind, buckets it
    comes in per layer) per phase, one bucket per layer (docs/planner.md: what each ZeRO stage
    moves). ZeRO 0 all-reduces once (FP32 gradients), 1 reduce-scatters once and all-gathers the
    weights, 2 reduce- scatters every microbatch, 3 also gathers the weights for every forward and
    backward; HSDP all-reduces across the replicas. fourd's FSDP on a CPU profile reduces only the
    last microbatch's gradients."""
    lay, par, cluster = job.layout, job.par, job.cluster
    micro, shard = par.microbatches, shard_group(lay, par.hsdp_replicas)
    buckets = max(1, layers)
    params = max_rank_params(job.model, lay.pp, par.virtual_stages, lay.tp)

    def bucketed(op: str, nbytes: float, group=shard) -> float:
        return buckets * collective_time(op, nbytes / buckets, group, cluster)

    gather = bucketed("all_gather", params * job.dtype_bytes)
    scatter = bucketed("reduce_scatter", 4 * params)
    replicas = replica_group(lay, par.hsdp_replicas)
    across = bucketed("all_reduce", 4 * params / shard.size, replicas)
    tail = stage.backward + bubble / 2  # the last backward and the cool-down
    head = stage.forward + bubble / 2  # the first forward and the warm-up
    reduces = 1 if cluster.cpu else micro
    if par.zero == 0:
        return [(bucketed("all_reduce", 4 * params), tail, 1)]
    if par.zero == 1:
        return [(scatter, tail, 1), (gather, head, 1)]
    if par.zero == 2:
        return [(reduces * scatter, reduces * stage.backward, reduces), (gather, head, 1)]
    backward_traffic = micro * gather + reduces * (scatter + across)
    return [
        (micro * gather, micro * stage.forward, micro),
        (backward_traffic, micro * stage.backward, micro),
    ]


def _dp_exposure(job: Job, stage: StageTime, bubble: float, layers: int) -> tuple[float, float]:
    """(exposed, total) seconds of the slowest rank's data-parallel traffic. Per phase
    (`_dp_phases`):

        exposed = max(0, traffic − window) + traffic / (buckets · k)

    what compute around it cannot hide, and the last bucket; all of it where the traffic does not
    run beside compute: on CPUs (collectives take the cores compute needs), with DeepSpeed's
    blocking pipeline engine (it reduces after the last backward), and where the stack does not
    overlap it (`dp_overlap`)."""
    phases = _dp_phases(job, stage, bubble, layers)
    buckets = max(1, layers)
    total = sum(traffic for traffic, _, _ in phases)
    exposed = sum(
        max(0.0, traffic - window) + traffic / (buckets * per_layer)
        for traffic, window, per_layer in phases
    )
    overlap = job.stack.dp_overlap
    hidden_by_stack = overlap == "bucketed" or (overlap == "zero3" and job.par.zero == 3)
    if job.cluster.cpu or job.pipeline_comm == "blocking" or not hidden_by_stack:
        return total, total
    return min(exposed, total), total


def step_time(job: Job) -> StepTime:
    """Seconds per optimizer step, and where they go:

        step = m · (t_f + t_b) + bubble + pipeline sends + exposed DP + OVERLAP_SLOWDOWN · hidden DP
               + optimizer

               + straggler

    for the slowest pipeline rank's per-microbatch t_f, t_b (TP and CP collectives included)."""
    lay, par, cluster = job.layout, job.par, job.cluster
    pp, micro = lay.pp, par.microbatches
    slow, stage = slowest_rank(job.work, pp, par.virtual_stages)
    blocking = job.pipeline_comm == "blocking"
    params = max_rank_params(job.model, pp, par.virtual_stages, lay.tp)
    if blocking:
        # DeepSpeed's engine adds each backward's BF16 weight gradients into FP32 ones, a pass of
        # its own
        accumulate = elementwise_time(GRAD_ACCUMULATE_BYTES * params, cluster)
        stage = stage + StageTime(
            forward_s=0.0,
            input_grad_s=0.0,
            weight_grad_s=accumulate,
            forward_comm_s=0.0,
            backward_comm_s=0.0,
        )
    p2p = _p2p_critical(job, pp, micro, blocking)
    layers = rank_shapes(job.model, pp, par.virtual_stages)[0][slow]
    tp_fwd, tp_bwd, cp_fwd, cp_bwd = layer_comm(job.work)
    redo = 2 if par.recompute == "full" else 1
    compute = micro * (stage.forward + stage.backward)
    bubble = 0.0
    if pp > 1:
        bubble = bubble_time(par.schedule, pp, micro, par.virtual_stages, stage)
    # CPU profiles: half the ranks work through warm-up and cool-down, on the cores the waiting half
    # leave
    server = min(lay.world, cluster.node.gpus)
    bubble *= cluster.core_share(server // 2) / cluster.core_share(server)
    exposed, total = _dp_exposure(job, stage, bubble, layers)
    overlap = OVERLAP_SLOWDOWN * (total - exposed)
    owned = params
    if par.zero >= 1:
        owned = params / shard_group(lay, par.hsdp_replicas).size
    optimizer = optimizer_time(owned, cluster, job.dtype_bytes)
    straggler = straggler_time(lay.world, cluster)
    return StepTime(
        step_s=compute + bubble + p2p + exposed + overlap + optimizer + straggler,
        compute_s=compute,
        bubble_s=bubble,
        p2p_s=p2p,
        dp_exposed_s=exposed,
        dp_total_s=total,
        overlap_s=overlap,
        optimizer_s=optimizer,
        straggler_s=straggler,
        tp_comm_s=micro * layers * (tp_fwd * redo + tp_bwd),
        cp_comm_s=micro * layers * (cp_fwd * redo + cp_bwd),
        slowest_rank=slow,
        per_microbatch=stage,
    )


def straggler_time(ranks: int, cluster: Cluster) -> float:
    """Seconds a step waits for its slowest rank: with independent jitter σ (STRAGGLER_JITTER_S) on
    each of N ranks that meet every step, the expected maximum lies about

        σ · √(2 ln N)

    above the mean (the extreme value of N normal variables). None on one rank, and none on a CPU
    profile, whose ranks share one host and whose turn-taking is measured (`Cluster.core_share`)."""
    if ranks <= 1 or cluster.cpu:
        return 0.0
    return STRAGGLER_JITTER_S * math.sqrt(2 * math.log(ranks))


def _p2p_critical(job: Job, pp: int, micro: int, blocking: bool) -> float:
    """Seconds of pipeline sends on the critical path: overlapped, those of warm-up and cool-down,
    where the first microbatch crosses every boundary between the p·V stages (each on the next rank)
    forward and the last one back: 2(p·V − 1) sends (2(p − 1) without interleaving); blocking, each
    microbatch after the first also waits for a middle rank's four (two on a two-rank pipeline): 2 ·
    min(2, p − 1) · (m − 1) more (docs/planner.md)."""
    if pp <= 1:
        return 0.0
    sends = 2 * (pp * job.par.virtual_stages - 1)
    if blocking:
        sends += 2 * min(2, pp - 1) * (micro - 1)
    return sends * p2p_time(job)
