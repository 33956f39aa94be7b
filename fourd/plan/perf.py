"""The time of a step: a layer's work and collectives, a pipeline stage, the schedule's bubble,
data-parallel traffic, the optimizer. `fourd sim step` schedules these same per-microbatch times.
Seconds, bytes, FLOP/s."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from fourd.plan.block import loss_bytes, matmuls, score_bytes, traffic
from fourd.plan.cluster import Cluster, Group, replica_group, shard_group
from fourd.plan.job import Job, Work
from fourd.plan.kernels import (
    attention_time,
    collective_time,
    elementwise_time,
    gemm_time,
    optimizer_time,
)
from fourd.plan.memory import max_rank_params, rank_shapes

# Compute beside a collective runs 18.9 % slower on average (Lee et al. 2025, "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv:2507.03114: GPT and
# Llama layers on 4 A100, H100, MI250 and MI210; the SMs, HBM and power the collective takes): c seconds of
# hidden traffic cost the compute beside them c · (1 − 1/1.189) seconds
OVERLAP_SLOWDOWN = 1 - 1 / 1.189
GRAD_ACCUMULATE_BYTES = 10  # per parameter: the BF16 gradient read, the FP32 sum read and written
# BF16 autocast over FP32 weights, per parameter: the cast of each weight to BF16 when a microbatch's
# forward uses it (read 4, write 2 B) and of its BF16 gradient back to FP32 (read 2, write 4 B); the
# FP32 gradient added into .grad by every microbatch after a step's first (read 4 + 4, write 4 B)
AUTOCAST_CAST_BYTES = 6
AUTOCAST_ACCUMULATE_BYTES = 12


@dataclass(frozen=True)
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
        return StageTime(
            self.forward_s + other.forward_s,
            self.input_grad_s + other.input_grad_s,
            self.weight_grad_s + other.weight_grad_s,
            self.forward_comm_s + other.forward_comm_s,
            self.backward_comm_s + other.backward_comm_s,
        )

    def scaled(self, k: float, comm: float | None = None) -> StageTime:
        """Compute times k times, communication `comm` times (default k)."""
        c = k if comm is None else comm
        return StageTime(
            self.forward_s * k,
            self.input_grad_s * k,
            self.weight_grad_s * k,
            self.forward_comm_s * c,
            self.backward_comm_s * c,
        )


@lru_cache(maxsize=8192)
def layer_comm(work: Work) -> tuple[float, float, float, float]:
    """(TP forward, TP backward, CP forward, CP backward) seconds of one layer's collectives, none
    overlapped (docs/planner.md: Shoeybi et al. 2019, Korthikanti et al. 2022 §4.2.2 with SP, Llama
    3 §3.3.2 for CP)."""
    model, cluster, lay, dtype_bytes = work.model, work.cluster, work.layout, work.dtype_bytes
    groups = work.groups
    act = work.tokens * model.dim * dtype_bytes
    kv_bytes = (
        2
        * max(1, model.kv_heads // lay.tp)
        * model.head_dim
        * work.micro_seqs
        * work.seq
        * dtype_bytes
    )
    kv_gather = collective_time("all_gather", kv_bytes, groups["cp"], cluster)
    cp_times = (
        kv_gather,
        kv_gather + collective_time("reduce_scatter", kv_bytes, groups["cp"], cluster),
    )
    if not work.sequence_parallel:
        reduce = collective_time("all_reduce", act, groups["tp"], cluster)
        return (2 * reduce, 2 * reduce, *cp_times)
    gather, scatter = sp_collectives(work)
    return (2 * (gather + scatter), 4 * gather + 2 * scatter, *cp_times)


def sp_collectives(work: Work) -> tuple[float, float]:
    """(all-gather, reduce-scatter) seconds of one of SP's TP collectives of a layer's activation.

    Under FP8 training the all-gathers move FP8, 1 B an element: Transformer Engine casts a
    column-parallel layer's input to FP8 before gathering it (the norm writes FP8 itself,
    `LayerNormLinear` and `LayerNormMLP`; the backward's re-gather of that saved FP8 shard for the
    weight gradient alike) and casts a row-parallel layer's output gradient to FP8 before gathering
    it (`grad_output_preprocess`, transformer_engine/pytorch/module/base.py, v1.x); the
    reduce-scatters sum the GEMMs' BF16 outputs and input gradients, at the activation's bytes."""
    elements = work.tokens * work.model.dim
    tp_group = work.groups["tp"]
    gather_bytes = 1 if work.fp8 else work.dtype_bytes
    return (
        collective_time("all_gather", elements * gather_bytes, tp_group, work.cluster),
        collective_time("reduce_scatter", elements * work.dtype_bytes, tp_group, work.cluster),
    )


def materialized_attention(work: Work) -> tuple[float, float]:
    """(forward, backward) seconds of attention that writes the s × s scores: two batched GEMMs,
    the memory-bound kernels between them (fourd.plan.block.score_bytes: Megatron's fused
    scale-mask-softmax and dropout, or each op eager), four GEMMs and those kernels' backward
    (Korthikanti et al. 2022 §4)."""
    model, cluster, dtype_bytes = work.model, work.cluster, work.dtype_bytes
    batch = work.micro_seqs * (model.heads // work.layout.tp)  # the GEMMs' batch, stacked into rows
    rows, keys, head_dim = batch * work.tokens // work.micro_seqs, work.seq, model.head_dim
    scores_t, values_t = (
        gemm_time(rows, keys, head_dim, cluster, dtype_bytes),
        gemm_time(rows, head_dim, keys, cluster, dtype_bytes),
    )
    scores, per_score = rows * keys, score_bytes(work)
    fwd = scores_t + values_t + elementwise_time(per_score.forward * scores, cluster)
    return fwd, scores_t + 3 * values_t + elementwise_time(per_score.backward * scores, cluster)


@lru_cache(maxsize=8192)
def layer_gemms(work: Work) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one layer's linear layers, one
    microbatch, on one rank of a (tp, cp) group; FP8 GEMMs under FP8 training (their casts are
    memory-bound traffic: fourd.plan.block.fp8_bytes)."""
    cluster, dtype_bytes, tokens, fp8 = work.cluster, work.dtype_bytes, work.tokens, work.fp8
    fwd = dgrad = wgrad = 0.0
    for out_dim, k in matmuls(work):
        fwd += gemm_time(tokens, out_dim, k, cluster, dtype_bytes, fp8)
        # the backward's FP8 GEMMs accumulate in split steps (fp8_gemm_time)
        dgrad += gemm_time(tokens, k, out_dim, cluster, dtype_bytes, fp8, split_accumulator=True)
        wgrad += gemm_time(k, out_dim, tokens, cluster, dtype_bytes, fp8, split_accumulator=True)
    return fwd, dgrad, wgrad


# Transformer Engine's userbuffers defaults (transformer_engine/pytorch/module/base.py, v1.4-1.7,
# `initialize_ub`): the forward's all-gathers (qkv_fprop, fc1_fprop) in `ring_exchange`, one chunk
# per TP rank; its reduce-scatters (proj_fprop, fc2_fprop) `pipeline`d in 4 splits; backward, the
# row-parallel layers' all-gathers of the output gradient (proj_dgrad, fc2_dgrad) in ring exchange,
# and the rest `bulk`, the whole collective beside another GEMM (qkv and fc1's dgrad and wgrad)
PIPELINE_SPLITS = 4


def overlapped(comm_s: float, gemm_s: float, unhidden: float) -> tuple[float, float]:
    """(exposed, hidden) seconds of collectives of `comm_s` run beside GEMMs of `gemm_s`, of which a
    share `unhidden` (the first chunk of each chunked collective) has nothing to overlap with: what
    the GEMMs cannot cover, max(0, c − g), plus min(c, g)·unhidden."""
    exposed = max(0.0, comm_s - gemm_s) + min(comm_s, gemm_s) * unhidden
    return exposed, comm_s - exposed


@dataclass(frozen=True, kw_only=True)
class LayerComm:
    """Seconds of one layer's collectives on the critical path, and what hidden ones cost the GEMMs
    beside them."""

    tp_forward: float
    tp_backward: float
    cp_forward: float
    cp_backward: float
    forward_slowdown: float = 0.0
    backward_slowdown: float = 0.0


@lru_cache(maxsize=8192)
def exposed_layer_comm(work: Work) -> LayerComm:
    """One layer's collectives: layer_comm, with TP overlap (work.tp_overlap: SP's two all-gathers and
    two reduce-scatters forward, four and two backward) only the exposed part of TP's collectives,
    chunked as Transformer Engine's defaults chunk them (PIPELINE_SPLITS above), and the GEMMs
    slowed by OVERLAP_SLOWDOWN of the part hidden beside them."""
    tp_f, tp_b, cp_f, cp_b = layer_comm(work)
    if not work.tp_overlap:
        return LayerComm(tp_forward=tp_f, tp_backward=tp_b, cp_forward=cp_f, cp_backward=cp_b)
    fwd, dgrad, wgrad = layer_gemms(work)
    gather, scatter = sp_collectives(work)
    tp = work.layout.tp
    first_chunks_f = 2 * gather / tp + 2 * scatter / PIPELINE_SPLITS
    first_chunks_b = 2 * gather / tp  # the bulk ones have a whole GEMM beside them
    exposed_f, hidden_f = overlapped(tp_f, fwd, first_chunks_f / tp_f)
    exposed_b, hidden_b = overlapped(tp_b, dgrad + wgrad, first_chunks_b / tp_b)
    return LayerComm(
        tp_forward=exposed_f,
        tp_backward=exposed_b,
        cp_forward=cp_f,
        cp_backward=cp_b,
        forward_slowdown=OVERLAP_SLOWDOWN * hidden_f,
        backward_slowdown=OVERLAP_SLOWDOWN * hidden_b,
    )


@lru_cache(maxsize=8192)
def attention_times(work: Work) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention core, one microbatch, on one rank of a
    (tp, cp) group: materialized scores (materialized_attention) or a fused kernel. CP ranks hold
    chunks i and 2·CP−1−i, so a fused kernel computes the causal tokens·seq/2 pairs (Llama 3
    §3.3.2), except on a CPU profile, where the chunks take torch's explicit-mask kernel, which
    computes all pairs."""
    if work.attention != "flash":
        return materialized_attention(work)
    model, cluster = work.model, work.cluster
    all_pairs = work.layout.cp > 1 and bool(cluster.gpu.attention)
    return attention_time(
        work.tokens,
        work.seq,
        model.heads // work.layout.tp,
        model.head_dim,
        cluster,
        not all_pairs,
        work.fused_attention,
    )


@lru_cache(maxsize=8192)
def layer_time(work: Work) -> StageTime:
    """One transformer layer, one microbatch, on one rank of a (tp, cp) group."""
    cluster, tp, dtype_bytes, tokens = work.cluster, work.layout.tp, work.dtype_bytes, work.tokens
    fwd, dgrad, wgrad = layer_gemms(work)
    if work.recompute == "per-op":
        # recomputed: every other matmul's forward
        for out_dim, k in matmuls(work)[1::2]:
            dgrad += gemm_time(tokens, out_dim, k, cluster, dtype_bytes, work.fp8)
    a_fwd, a_bwd = attention_times(work)
    per_token = traffic(work)
    fwd += a_fwd + elementwise_time(tokens * per_token.forward, cluster)
    dgrad += a_bwd + elementwise_time(tokens * (per_token.backward + per_token.redo), cluster)
    # the CPU time a CPU profile measured fourd's TP (DTensor) and FSDP to add per layer, a third
    # forward
    cpu = 0.0
    if tp > 1:
        cpu += cluster.gpu.tp_layer_us
    if work.fsdp:
        cpu += cluster.gpu.fsdp_layer_us
    fwd, dgrad = fwd + cpu * 1e-6 / 3, dgrad + cpu * 2e-6 / 3
    comm = exposed_layer_comm(work)
    fwd += comm.forward_slowdown
    dgrad += comm.backward_slowdown
    fwd_comm = comm.tp_forward + comm.cp_forward
    bwd_comm = comm.tp_backward + comm.cp_backward
    if work.recompute == "full":
        dgrad += fwd
        bwd_comm += fwd_comm
    elif work.recomputes_attention:
        dgrad += a_fwd  # the attention core, run again from the Q, K and V it kept
    return StageTime(fwd, dgrad, wgrad, fwd_comm, bwd_comm)


def _head_time(work: Work, tp_group: Group) -> StageTime:
    """Final norm, output projection (vocabulary split over TP) and torch's cross-entropy on the
    logits."""
    cluster, tokens, tp, dtype_bytes = work.cluster, work.tokens, work.layout.tp, work.dtype_bytes
    dim, vocab_shard, seq_parallel = work.model.dim, work.model.vocab // tp, work.sequence_parallel
    norm = 4 * dim * dtype_bytes * tokens / (tp if seq_parallel else 1)
    loss_f, loss_b, _ = loss_bytes(dtype_bytes)
    fwd = gemm_time(tokens, vocab_shard, dim, cluster, dtype_bytes) + elementwise_time(
        norm + loss_f * tokens * vocab_shard, cluster
    )
    dgrad = gemm_time(tokens, dim, vocab_shard, cluster, dtype_bytes) + elementwise_time(
        2 * norm + loss_b * tokens * vocab_shard, cluster
    )
    wgrad = gemm_time(dim, vocab_shard, tokens, cluster, dtype_bytes)
    act = tokens * dim * dtype_bytes
    # the vocabulary-parallel loss all-reduces max, sum and target logit; SP gathers the input first
    # and reduce-scatters its gradient, plain TP all-reduces the gradient
    loss = collective_time("all_reduce", 3 * 4 * tokens, tp_group, cluster)
    if not seq_parallel:
        return StageTime(
            fwd, dgrad, wgrad, loss, collective_time("all_reduce", act, tp_group, cluster)
        )
    comm_f = collective_time("all_gather", act, tp_group, cluster) + loss
    return StageTime(
        fwd, dgrad, wgrad, comm_f, collective_time("reduce_scatter", act, tp_group, cluster)
    )


def compute_share(ranks: int, cluster: Cluster) -> float:
    """How much slower each rank computes while `ranks` ranks are busy on a server whose cores they
    share (CPU profiles; GPUs: 1): ranks beyond `concurrent_ranks` take turns, and the busy cores
    together reach the all-core peak, not one core's rate times the cores (they share the memory
    bus and the all-core clock):

        share = core_share(ranks) · max(1, busy · one core's best GEMM rate / all-core peak)

    with busy = min(ranks, cores)."""
    slots = cluster.node.concurrent_ranks
    if not slots:
        return 1.0
    gpu, busy = cluster.gpu, min(ranks, cluster.node.gpus, slots)
    one = max(sample.tflops for sample in gpu.gemm) if gpu.gemm else gpu.peak_tflops / slots
    return cluster.core_share(ranks) * max(1.0, busy * one / gpu.peak_tflops)


@lru_cache(maxsize=16384)
def stage_time(work: Work, layers: int, first: bool = False, last: bool = False) -> StageTime:
    """One microbatch through a pipeline stage of `layers` layers (plus the embedding if `first`,
    the output and loss if `last`) on one GPU; TP and CP collectives included as exposed
    communication."""
    tp_group, cluster = work.groups["tp"], work.cluster
    stage = layer_time(work).scaled(layers)
    if first:
        # the vocabulary-parallel lookup: partial rows reduce-scattered into the SP shard (or
        # all-reduced)
        act = work.tokens * work.model.dim * work.dtype_bytes
        ops = ("reduce_scatter", "all_gather") if work.sequence_parallel else ("all_reduce", "none")
        comm = [collective_time(op, act, tp_group, cluster) if op != "none" else 0.0 for op in ops]
        stage = stage + StageTime(
            elementwise_time(act, cluster), elementwise_time(2 * act, cluster), 0.0, *comm
        )
    if last:
        stage = stage + _head_time(work, tp_group)
    # collective_time counts the core share itself
    return stage.scaled(compute_share(work.layout.world, cluster), comm=1.0)


def chunk_times(job: Job) -> list[StageTime]:
    """StageTime of each global pipeline stage 0 .. pp·V−1 in model order (stage s runs on rank s %
    pp)."""
    counts = job.stage_layers
    return [
        stage_time(job.work, layers, stage == 0, stage == len(counts) - 1)
        for stage, layers in enumerate(counts)
    ]


@lru_cache(maxsize=16384)
def rank_stage_times(work: Work, p: int, virtual_stages: int) -> tuple[StageTime, ...]:
    """One microbatch through each of `p` pipeline ranks, all its chunks (the first rank's with the
    embedding, the last rank's with the output layer and the loss); ranks of equal layers and place
    share one computation."""
    layers = rank_shapes(work.model, p, virtual_stages, work.pipeline_split)[0]
    times: dict[tuple[int, bool, bool], StageTime] = {}
    for rank, count in enumerate(layers):
        kind = (count, rank == 0, rank == p - 1)
        if kind not in times:
            times[kind] = stage_time(work, *kind)
    return tuple(times[(count, rank == 0, rank == p - 1)] for rank, count in enumerate(layers))


@lru_cache(maxsize=16384)
def slowest_rank(work: Work, p: int, virtual_stages: int) -> tuple[int, StageTime]:
    """The pipeline rank with the most work per microbatch (embedding and head included), and that
    work."""
    kinds = rank_shapes(work.model, p, virtual_stages, work.pipeline_split)[2]
    times = rank_stage_times(work, p, virtual_stages)
    rank = max(kinds, key=lambda rank: times[rank].forward + times[rank].backward)
    return rank, times[rank]


def p2p_time(job: Job) -> float:
    """One activation (or its gradient) sent between adjacent pipeline ranks, at the slowest
    boundary (where the pipeline spans servers some neighbours are on two). With SP each TP rank
    sends its shard; blocking (DeepSpeed's engine) partitions it over TP too and gathers it on
    arrival."""
    work, lay = job.work, job.layout
    full = work.tokens * work.model.dim * work.dtype_bytes
    split = work.sequence_parallel or job.pipeline_sends != "overlapped"
    gather = 0.0
    if split and not work.sequence_parallel:
        gather = collective_time("all_gather", full, work.groups["tp"], job.cluster)
    return (
        collective_time("send", full / (lay.tp if split else 1), work.groups["pp"], job.cluster)
        + gather
    )


def bubble_time(
    schedule: str, pp: int, microbatches: int, virtual_stages: int, stage: StageTime
) -> float:
    """Idle time of a pipeline rank per step for per-microbatch times `stage` (all its layers): the
    closed forms of fourd.schedules' lists (docs/simulators.md)."""
    p, v = pp, virtual_stages
    whole = stage.forward + stage.backward
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * whole
    if schedule == "interleaved":
        return ((p - 1) * v - (v - 1) * (min(microbatches, p) - 1)) * whole / v
    return (p - 1) * max(
        0.0, stage.forward + stage.input_grad_s + stage.backward_comm_s - stage.weight_grad_s
    )


@dataclass(frozen=True)
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
    tp_comm_s: float  # part of compute_s
    cp_comm_s: float  # part of compute_s
    slowest_rank: int
    per_microbatch: StageTime  # the slowest pipeline rank, all its stages


class DpPhase(NamedTuple):
    """One phase of a step's data-parallel traffic: its seconds, the compute beside it that can
    hide them, the passes it comes in (microbatches), the buckets of a pass, and the seconds of the
    last pass's reduction of gradients that arrive only as its compute ends (the input
    embedding's); nothing hides the larger of those and the last bucket."""

    seconds: float
    window: float
    passes: int
    buckets: int
    last_ready_s: float = 0.0

    def exposed(self) -> float:
        """Seconds of the phase no compute hides: what overruns its window, and its tail."""
        last_bucket = self.seconds / (self.buckets * self.passes)
        return max(0.0, self.seconds - self.window) + max(last_bucket, self.last_ready_s)


def _dp_exposure(job: Job, t: StageTime, bubble: float, layers: int) -> tuple[float, float]:
    """(exposed, total) seconds of the slowest rank's ZeRO/DDP traffic: weights gathered one layer
    at a time, gradients reduced in the stack's buckets (`Job.gradient_buckets`), each its own
    collective call; what compute around it cannot hide, and the last bucket, are exposed
    (docs/planner.md: what each ZeRO stage moves); with them, a tied embedding's sync across the
    pipeline (`tied_embedding_sync`), exposed."""
    lay, par, cluster = job.layout, job.par, job.cluster
    shard = shard_group(lay, par.hsdp_replicas, job.work.rank_order)
    params = rank_params(job)
    gathers, reductions = max(1, layers), job.gradient_buckets(params, layers)

    def bucketed(op: str, nbytes: float, buckets: int, group=shard) -> float:
        return buckets * collective_time(op, nbytes / buckets, group, cluster)

    # the input embedding's gradient is the backward's last: its share of a pass's reduction waits
    # for the pass's end
    embedding_share = min(1.0, job.model.embedding_params() / lay.tp / params)
    in_step = tied_embedding_sync(job)
    grad_bytes = job.grad_reduce_bytes  # the stack's reduction precision (FP32 or BF16)
    if par.zero == 0:
        passes = PassSeconds(all_reduce=bucketed("all_reduce", grad_bytes * params, reductions))
    else:
        if job.reduces_whole_gradients:
            # over every rank that shares the weights, replica groups included
            every = shard_group(lay, 1, job.work.rank_order)
            scatter = bucketed("all_reduce", grad_bytes * params, reductions, every)
            across = 0.0
        else:
            scatter = bucketed("reduce_scatter", grad_bytes * params, reductions)
            across = _across_replicas(job, grad_bytes * params / shard.size, reductions)
        passes = PassSeconds(
            gather=_weight_gather(job, params, gathers, shard), scatter=scatter, across=across
        )
        if job.gathers_in_step:  # ZeRO 1 and 2's gather inside the optimizer's step, unhidden
            in_step += passes.gather
    phases = _dp_phases(job, t, bubble, embedding_share, passes, gathers, reductions)
    total = in_step + sum(phase.seconds for phase in phases)
    exposed = in_step + sum(phase.exposed() for phase in phases)
    return min(exposed, total), total


def _across_replicas(job: Job, shard_bytes: float, reductions: int) -> float:
    """Seconds of HSDP's all-reduce of each reduced shard across the replica groups, in the stack's
    buckets (`hsdp_replicas` > 1, ZeRO 1 to 3; 0 without replicas)."""
    if not job.par.hsdp:
        return 0.0
    replicas = replica_group(job.layout, job.par.hsdp_replicas, job.work.rank_order)
    return reductions * collective_time(
        "all_reduce", shard_bytes / reductions, replicas, job.cluster
    )


def _weight_gather(job: Job, params: float, gathers: int, shard: Group) -> float:
    """Seconds of one pass of a ZeRO stage's weight gather over `shard`: one all-gather a layer, or,
    where the stack broadcasts each rank's updated shard on its own (ZeRO 1 and 2's
    `weight_gather = "broadcast"`: InternEvo's broadcast_params, one dist.broadcast per rank of the
    group), one ring broadcast of a shard per rank, each its own call and its n − 1 steps:

        n · (latency of a broadcast over n ranks) + n · (params · bytes / n) / bus bandwidth."""
    nbytes = params * job.state_dtype_bytes
    if job.broadcasts_weights:
        return shard.size * collective_time("broadcast", nbytes / shard.size, shard, job.cluster)
    return gathers * collective_time("all_gather", nbytes / gathers, shard, job.cluster)


class PassSeconds(NamedTuple):
    """Seconds of one pass of each data-parallel collective a ZeRO stage runs (0 for the others):
    ZeRO 0's gradient all-reduce; ZeRO 1-3's weight all-gather and gradient reduce-scatter; HSDP's
    all-reduce of the shards across the replicas."""

    all_reduce: float = 0.0
    gather: float = 0.0
    scatter: float = 0.0
    across: float = 0.0


def _dp_phases(
    job: Job,
    t: StageTime,
    bubble: float,
    embedding_share: float,
    passes: PassSeconds,
    gathers: int,
    reductions: int,
) -> list[DpPhase]:
    """The phases of a step's data-parallel traffic (`_dp_exposure`): ZeRO 0 all-reduces after the
    last backward; ZeRO 1 reduce-scatters there and gathers the updated weights beside the next
    step's warm-up (or inside the optimizer's step, the stack's gather_in_step: no phase then); ZeRO
    2 reduce-scatters after every microbatch's backward; ZeRO 3 also gathers each layer for every
    forward and backward."""
    microbatches, reduces = job.par.microbatches, reductions_per_step(job)
    tail = t.backward + bubble / 2  # the last backward and the cool-down
    head = t.forward + bubble / 2  # the warm-up
    if job.par.zero == 0:
        return [
            DpPhase(passes.all_reduce, tail, 1, reductions, embedding_share * passes.all_reduce)
        ]
    beside_forward = 0.0 if job.gathers_in_step else passes.gather
    reduced = passes.scatter + passes.across  # HSDP: the shard all-reduced across the replicas
    scatter_tail = embedding_share * reduced  # a pass's seconds after its backward
    if job.par.zero == 1:
        return [
            DpPhase(reduced, tail, 1, reductions, scatter_tail),
            DpPhase(beside_forward, head, 1, gathers),
        ]
    if job.par.zero == 2:
        return [
            DpPhase(reduces * reduced, reduces * t.backward, reduces, reductions, scatter_tail),
            DpPhase(beside_forward, head, 1, gathers),
        ]
    return [
        DpPhase(microbatches * passes.gather, microbatches * t.forward, microbatches, gathers),
        DpPhase(
            microbatches * passes.gather + reduces * reduced,
            microbatches * t.backward,
            microbatches,
            gathers,
            embedding_share * reduced,
        ),
    ]


def reductions_per_step(job: Job) -> int:
    """How often a step reduce-scatters ZeRO 2 and 3's gradients: after each microbatch's backward,
    as the GPU stacks do; once, after the last, on CPU profiles (fourd's FSDP turns the gradient sync
    off for the others)."""
    return 1 if job.cluster.cpu else job.par.microbatches


def tied_embedding_sync(job: Job) -> float:
    """Seconds of the all-reduce that keeps a tied embedding's two copies equal across a pipeline:
    the first stage's input embedding and the last stage's output projection each get a gradient,
    summed between the two stages' ranks after the backward and before the optimizer, where nothing
    hides it (Megatron's embedding group: `_allreduce_word_embedding_grads`,
    megatron/core/distributed/finalize_model_grads.py), the gradient of vocab·dim/tp parameters in
    the stack's reduction precision (`Job.grad_reduce_bytes`). 0 untied or without a pipeline."""
    lay = job.layout
    if not job.model.tied_embeddings or lay.pp == 1:
        return 0.0
    pipeline = job.work.groups["pp"]
    ends = Group(2, pipeline.stride * (lay.pp - 1), lay.world)  # a first and a last stage's ranks
    nbytes = job.grad_reduce_bytes * job.model.embedding_params() / lay.tp
    return collective_time("all_reduce", nbytes, ends, job.cluster)


def _pipeline_sends_time(job: Job) -> float:
    """Seconds of pipeline sends on the critical path of a step. Overlapped, the sends of warm-up
    and cool-down are on it: the first microbatch crosses every boundary between the p·V stages
    forward (each stage on the next rank) and the last one back, 2(p·V − 1) sends (2(p − 1)
    without interleaving); synchronous (Megatron's batched exchanges, each waited for), each later
    microbatch also waits for its rank's two exchanges per stage it runs, 2·V; blocking
    (DeepSpeed's pipeline engine), each microbatch after the first also waits for a middle rank's
    four (two on a two-rank pipeline): docs/planner.md."""
    pp, par = job.layout.pp, job.par
    if pp <= 1:
        return 0.0
    later_microbatches = par.microbatches - 1
    sends = 2 * (pp * par.virtual_stages - 1)
    if job.pipeline_sends == "blocking":
        sends += 2 * min(2, pp - 1) * later_microbatches
    elif job.pipeline_sends == "synchronous":
        sends += 2 * par.virtual_stages * later_microbatches
    return sends * p2p_time(job)


def rank_params(job: Job) -> float:
    """Parameters the fullest pipeline rank holds (its stages' layers, over TP), as the stack
    splits the layers."""
    par = job.par
    return max_rank_params(
        job.model, job.layout.pp, par.virtual_stages, job.layout.tp, job.work.pipeline_split
    )


def gradient_sum_time(job: Job, params: float) -> float:
    """Seconds a microbatch spends adding its BF16 weight gradients into FP32 copies apart from the
    backward, where the stack does (`Job.accumulates_apart`: DeepSpeed's pipeline engine, nanotron's
    FP32 gradient accumulator), over the `params` its rank holds:

        GRAD_ACCUMULATE_BYTES · params / HBM rate   (read 2 + 4, write 4 bytes a parameter)

    0 where the stack sums inside the weight-gradient GEMM or keeps one precision."""
    if not job.accumulates_apart:
        return 0.0
    return elementwise_time(GRAD_ACCUMULATE_BYTES * params, job.cluster)


def autocast_passes(job: Job, params: float) -> StageTime:
    """Per microbatch, the memory-bound passes of BF16 autocast over `params` FP32 weights (a rank's
    or a pipeline stage's: every parameter it holds; norms and biases are few, and the embedding,
    looked up uncast, still has its FP32 gradient written and summed). torch.autocast casts a weight
    at its first use in an autocast region and keeps the copy until the region exits (its weight
    cache, `cache_enabled`, on by default): a region per microbatch casts every weight each forward,
    a pipeline's one region around its schedule (fourd) once a step; a full recomputation's forward
    runs in a region of its own and casts again. Backward casts each gradient back to FP32, and
    every microbatch after the first adds it into the FP32 gradient (the first is taken as is):

        forward  = casts/m · 6 B · params,  input_grad = 6 B · params (full recomputation),
        weight_grad = (6 + 12 · (m − 1)/m) B · params   at HBM speed;

    nothing without autocast."""
    if not job.work.autocast:
        return StageTime(0.0, 0.0, 0.0, 0.0, 0.0)
    microbatches = job.par.microbatches
    casts = 1 if job.layout.pp > 1 else microbatches
    cast = elementwise_time(AUTOCAST_CAST_BYTES * params, job.cluster)
    redo = cast if job.par.recompute == "full" else 0.0
    summed_share = (microbatches - 1) / microbatches  # the microbatches whose gradient is summed
    accumulate = elementwise_time(AUTOCAST_ACCUMULATE_BYTES * params * summed_share, job.cluster)
    return StageTime(cast * casts / microbatches, redo, cast + accumulate, 0.0, 0.0)


def sharding_copies(job: Job, params: float) -> StageTime:
    """Per microbatch, the copies on the compute stream of a stack that shards weights parameter
    by parameter (the stack's `sharding_copies`: FSDP2's fully_shard) over the `params` weights a
    rank holds, where ZeRO 2 or 3 shards them over more than one rank. A gather's output lands in one
    flat buffer and is copied into the parameters (foreach_all_gather_copy_out's
    split_with_sizes_copy); a reduction's input is one flat FP32 buffer the gradients are copied
    into (foreach_reduce's chunk_cat, torch.distributed.fsdp._fully_shard._fsdp_collectives):

        forward     = gathers_f · 2·w · params / HBM rate
        weight_grad = (gathers_b · 2·w + (reduces / m) · (g + 4)) · params / HBM rate

    w: bytes of a gathered weight, g: of a gradient as the backward writes it (the training
    precision's), 4: of its FP32 copy. ZeRO 3 gathers each microbatch's weights before its forward
    and again before its backward (gathers_f = gathers_b = 1), ZeRO 2 once a step (gathers_f = 1/m,
    gathers_b = 0); `reduces` of the m microbatches reduce (reductions_per_step). Nothing for flat
    parameters (FSDP1: the parameters are views of the gathered buffer, and the gradient is cast
    on the post-backward stream, beside compute)."""
    if not (job.shards_by_parameter and job.work.fsdp and job.par.zero >= 2):
        return StageTime(0.0, 0.0, 0.0, 0.0, 0.0)
    microbatches = job.par.microbatches
    reshards = job.par.zero == 3  # ZeRO 3 gathers again before each backward; ZeRO 2 once a step
    forward_gathers = 1.0 if reshards else 1 / microbatches
    backward_gathers = 1.0 if reshards else 0.0
    copy_out = elementwise_time(2 * job.state_dtype_bytes * params, job.cluster)
    copy_in = elementwise_time((job.dtype_bytes + 4) * params, job.cluster)
    reduced_share = reductions_per_step(job) / microbatches
    backward = backward_gathers * copy_out + reduced_share * copy_in
    return StageTime(forward_gathers * copy_out, 0.0, backward, 0.0, 0.0)


def weight_passes(job: Job, params: float) -> StageTime:
    """Per microbatch, every memory-bound pass over the `params` weights a rank or stage holds:
    autocast's casts and sums (autocast_passes), a stack's FP32 gradient sum apart
    (gradient_sum_time, in the weight-gradient part) and FSDP2's copies (sharding_copies)."""
    summed = StageTime(0.0, 0.0, gradient_sum_time(job, params), 0.0, 0.0)
    return autocast_passes(job, params) + summed + sharding_copies(job, params)


def sync_waits(job: Job, stage: StageTime) -> StageTime:
    """CPU profiles: what a rank's compute loses waiting at its collectives for the other ranks,
    which reach them apart, per microbatch (every multi-rank layout synchronizes within one: TP and
    CP every layer, FSDP's gathers every layer, a pipeline's sends every stage):

        waits = share · (forward, input gradient, weight gradient), communication 0,

    the share measured by `fourd calibrate` (fourd.measure.calibrate._sync_share) with the layout's
    pattern: `sync_share` with TP's (an all-reduce after every GEMM pair, forward and backward),
    `layer_sync_share` without TP (FSDP's gather before a layer and scatter after it; CP's gathers
    and scatters and a pipeline's sends are no denser). With more ranks than cores
    (ranks > concurrent_ranks) a waiting rank hands its core to another, which hides the wait only
    if that rank has work of its own: a pipeline's stages run apart between their sends, so a
    layout with a pipeline loses nothing; without one every rank waits at the same layer's
    collectives (TP's all-reduces, FSDP's gathers), and the waits stay. Measured on 2 cores, 4 gloo
    workers running the sync-share loop (docs/planner.md, "Coupled ranks"): as two independent TP
    pairs the loop lost 0.00-0.09 of its compute beyond its halves, coupled into a 2 × 2 mesh by a
    data-parallel all-gather each layer 0.11-0.28, as two workers on their own cores lose."""
    cluster, ranks = job.cluster, job.layout.world
    slots = cluster.node.concurrent_ranks
    share = cluster.node.sync_share if job.layout.tp > 1 else cluster.node.layer_sync_share
    if not slots or ranks <= 1 or share <= 0:
        return StageTime(0.0, 0.0, 0.0, 0.0, 0.0)
    if ranks > slots and job.layout.pp > 1:  # the stages take turns on the cores
        return StageTime(0.0, 0.0, 0.0, 0.0, 0.0)
    return stage.scaled(share, comm=0.0)


def rank_busy(work: Work, p: int, virtual_stages: int) -> tuple[float, ...]:
    """Seconds of one microbatch's forward and backward on each of `p` pipeline ranks
    (rank_stage_times)."""
    return tuple(
        stage.forward + stage.backward for stage in rank_stage_times(work, p, virtual_stages)
    )


def fill_and_drain_saving(job: Job) -> float:
    """What a GPipe, 1F1B or interleaved pipeline's fill and drain take less than its closed form at
    the slowest rank's pace when its ranks differ (the last one with the output layer and the loss):
    the first microbatch reaches the slowest rank, and the last one leaves it, through the other
    ranks at their own pace, so the bubble's closed form holds at their mean microbatch t̄_other,
    not at the slowest's t_slowest:

        saving = bubble(p, m, V; t_slowest − t̄_other)
               = (p − 1)·(t_slowest − t̄_other) = Σ_r (t_slowest − t_r)    (GPipe, 1F1B)

    `fourd sim step`'s events on the same costs give the bubble this leaves (to 1e-16 for 1F1B with
    the last rank the slowest; within 0.02 % interleaved, whose first chunk also carries the
    embedding). 0 at equal ranks; the zero-bubble schedule keeps its closed form."""
    lay, par = job.layout, job.par
    if lay.pp <= 1 or par.schedule == "zero-bubble":
        return 0.0
    times = rank_busy(job.work, lay.pp, par.virtual_stages)
    slowest = max(times)
    others = (sum(times) - slowest) / (lay.pp - 1)
    gap = StageTime(slowest - others, 0.0, 0.0, 0.0, 0.0)
    return bubble_time(par.schedule, lay.pp, par.microbatches, par.virtual_stages, gap)


def _bubble_seconds(job: Job, stage: StageTime) -> float:
    """The schedule's bubble per step on the slowest rank, whose stages take `stage` per
    microbatch, less what fill and drain save through faster ranks (fill_and_drain_saving). CPU
    profiles: half the ranks work through warm-up and cool-down, on the cores the waiting half
    leave, as crowded as half the ranks make them."""
    lay, par = job.layout, job.par
    bubble = 0.0
    if lay.pp > 1:
        bubble = bubble_time(par.schedule, lay.pp, par.microbatches, par.virtual_stages, stage)
        bubble -= fill_and_drain_saving(job)
    server = min(lay.world, job.cluster.node.gpus)
    crowding = compute_share(server // 2, job.cluster) / compute_share(server, job.cluster)
    return bubble * crowding


def step_floor(job: Job) -> float:
    """A floor under step_time(job).step_s, cheaper than the step time (the search times in full
    only the configurations whose floor could still rank them among the best):

        floor = m · (t_f + t_b) + bubble(t_f, t_b)

    of the slowest pipeline rank's stage as slowest_rank gives it, before the passes over its
    weights and the CPU waits step_time adds to it (each ≥ 0), so m · (t_f + t_b) is at most the
    step's compute; the bubble grows with t_f + t_b under every schedule but zero-bubble's, whose
    deferred weight gradients shrink it, and is left out there. Every other term of a step (sends,
    exposed DP traffic, the slowdown beside it, the optimizer) is ≥ 0. In floating point each sum
    and product of non-negative terms is monotone, so the floor is a floor bit for bit too
    (tests/test_contract_search.py checks it on every configuration of several searches)."""
    par = job.par
    _, stage = slowest_rank(job.work, job.layout.pp, par.virtual_stages)
    compute = par.microbatches * (stage.forward + stage.backward)
    if par.schedule == "zero-bubble":
        return compute
    return compute + _bubble_seconds(job, stage)


def step_time(job: Job) -> StepTime:
    """Seconds per optimizer step, and where they go."""
    lay, par = job.layout, job.par
    pp, microbatches = lay.pp, par.microbatches
    slow, stage = slowest_rank(job.work, pp, par.virtual_stages)
    blocking = job.pipeline_sends == "blocking" and pp > 1  # DeepSpeed's pipeline engine
    split = job.work.pipeline_split
    params = rank_params(job)
    stage = stage + weight_passes(job, params)
    stage = stage + sync_waits(job, stage)
    p2p = _pipeline_sends_time(job)
    layers = rank_shapes(job.model, pp, par.virtual_stages, split)[0][slow]
    comm = exposed_layer_comm(job.work)
    redo = 2 if par.recompute == "full" else 1
    compute = microbatches * (stage.forward + stage.backward)
    bubble = _bubble_seconds(job, stage)
    exposed, total = _dp_exposure(job, stage, bubble, layers)
    if job.cluster.cpu or blocking or not job.dp_overlapped:
        # on CPUs collectives run on the cores compute needs; DeepSpeed's engine, and a stack that
        # does not overlap DP traffic, reduce after the last backward
        exposed = total
    overlap = OVERLAP_SLOWDOWN * (total - exposed)
    owned = params / (shard_group(lay, par.hsdp_replicas).size if par.zero >= 1 else 1)
    optimizer = optimizer_time(owned, job.cluster, job.state_dtype_bytes)
    step = compute + bubble + p2p + exposed + overlap + optimizer
    tp_comm = microbatches * layers * (comm.tp_forward * redo + comm.tp_backward)
    cp_comm = microbatches * layers * (comm.cp_forward * redo + comm.cp_backward)
    return StepTime(
        step,
        compute,
        bubble,
        p2p,
        exposed,
        total,
        overlap,
        optimizer,
        tp_comm,
        cp_comm,
        slow,
        stage,
    )
