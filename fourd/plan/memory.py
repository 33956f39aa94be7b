"""Memory per GPU, bytes: weights, gradients and optimizer state by ZeRO stage, the activations a
layer keeps times the schedule's microbatches in flight, the logits, FSDP's gathered layers, the
allocator's cache, the runtime (docs/planner.md derives each term)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from fourd.plan.block import loss_bytes, traffic
from fourd.plan.job import Job, stage_layers

GB = 1e9
# PyTorch's CUDA caching allocator keeps freed blocks for reuse: reserved over allocated, less one.
# Fitted. (Its CPU allocator returns freed memory to malloc: nothing on CPU profiles.)
ALLOCATOR_FRAGMENTATION = 0.252


def state_bytes_per_param(zero: int, dp: int, dtype_bytes: int = 2) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter for ZeRO stage 0-3 over dp ranks: 2 + 2 +
    12 in mixed precision, 4 + 4 + 8 in FP32 (Rajbhandari et al. 2020 §5)."""
    w = g = dtype_bytes
    opt = 12 if dtype_bytes == 2 else 8
    return (w / dp if zero >= 3 else w, g / dp if zero >= 2 else g, opt / dp if zero >= 1 else opt)


def stage_params(model, counts: list[int], stage: int) -> int:
    """Parameters of one pipeline stage (whole, before TP)."""
    p = counts[stage] * model.layer_params()
    if stage == 0:
        p += model.embedding_params()
    if stage == len(counts) - 1:
        p += model.embedding_params() + (model.dim if model.mlp == "swiglu" else 2 * model.dim)
    return p


@lru_cache(maxsize=4096)
def rank_shapes(
    model, pp: int, virtual_stages: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(layers per pipeline rank, parameters per pipeline rank before TP, the ranks that can peak in
    memory: in-flight microbatches fall with the rank, so besides the last (logits) the first with
    each layer count)."""
    counts = stage_layers(model.layers, pp, virtual_stages)
    layers = tuple(sum(counts[s] for s in range(r, len(counts), pp)) for r in range(pp))
    params = tuple(
        sum(stage_params(model, counts, s) for s in range(r, len(counts), pp)) for r in range(pp)
    )
    first_with = {n: r for r, n in reversed(list(enumerate(layers)))}
    return layers, params, tuple(sorted({0, pp - 1, *first_with.values()}))


def max_rank_params(model, pp: int, virtual_stages: int, tp: int) -> float:
    """Parameters on the GPU that holds the most (what its data-parallel collectives move)."""
    return max(rank_shapes(model, pp, virtual_stages)[1]) / tp


def in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int, rank: int) -> float:
    """Microbatches whose activations pipeline rank `rank` holds at its peak, in units of all its
    layers: the closed forms of fourd.schedules' lists (docs/simulators.md's "peak in flight"; the
    tests check them)."""
    m, p, v = microbatches, pp, virtual_stages
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    if schedule == "zero-bubble":
        return min(p, m)
    rounds = max(1, m // p)
    first_round = -(-m // rounds)
    return min(m * v, (v - 1) * first_round + 2 * (p - rank - 1) + 1) / v


@dataclass(frozen=True, kw_only=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    other: float  # logits of the loss, gathered ZeRO-3 buffers
    fragmentation: float  # what the caching allocator keeps reserved beyond the tensors
    reserve: float  # the runtime's: CUDA context, NCCL's buffers

    @property
    def total(self) -> float:
        """Bytes of tensors at the peak (torch's max_memory_allocated)."""
        return self.params + self.grads + self.optimizer + self.activations + self.other

    @property
    def held(self) -> float:
        """All a GPU holds at the peak: the tensors, the allocator's cache and the runtime."""
        return self.total + self.fragmentation + self.reserve

    def fits(self, capacity: float) -> bool:
        """The tensors and the runtime fit: before it gives up, the allocator frees what it keeps
        cached."""
        return self.total + self.reserve <= capacity

    def gb(self) -> dict:
        names = (
            "params",
            "grads",
            "optimizer",
            "activations",
            "other",
            "fragmentation",
            "reserve",
            "total",
        )
        return {k: getattr(self, k) / GB for k in names}


def rank_memories(job: Job, ranks) -> list[Memory]:
    """Peak memory of one GPU of each pipeline rank in `ranks`: the ZeRO state of its parameters
    (weights, gradients, optimizer: `state_bytes_per_param` over the shard group), the activations
    of the microbatches in flight, and the rest (`other`): a recomputed layer's whole activations,
    the last rank's logits, FSDP's gathered layer and the next (ZeRO 3), the embedding and output on
    the edge ranks; the caching allocator's cache ALLOCATOR_FRAGMENTATION of all of it (none on CPU
    profiles)."""
    par, lay, work, model = job.par, job.layout, job.work, job.model
    dtype_bytes = job.dtype_bytes
    layers, params, _ = rank_shapes(model, lay.pp, par.virtual_stages)
    # FSDP shards over dp×cp (or an HSDP group)
    weight_b, grad_b, optim_b = state_bytes_per_param(par.zero, par.shard_ranks, dtype_bytes)
    per_layer = work.tokens * traffic(work).saved
    # while a layer is recomputed it holds all its activations for one microbatch
    recomputed = 0.0
    if par.recompute == "full":
        recomputed = work.tokens * traffic(replace(work, recompute="none")).saved
    # the loss's, for one microbatch: the last rank
    logits = loss_bytes(dtype_bytes)[2] * work.tokens * model.vocab / lay.tp
    layer = model.layer_params()
    gathered = edge = 0.0
    if par.zero == 3:
        gathered = 2 * layer / lay.tp * dtype_bytes  # FSDP's gathered layer and the next
        edge = (
            2 * max(0, model.embedding_params() - layer) / lay.tp * dtype_bytes
        )  # embedding, output
    out: list[Memory] = []
    reserve = job.cluster.gpu.memory_reserve_gb * GB
    last = lay.pp - 1
    for rank in ranks:
        mine = params[rank] / lay.tp
        in_flight_now = in_flight(par.schedule, lay.pp, par.microbatches, par.virtual_stages, rank)
        acts = in_flight_now * layers[rank] * per_layer
        other = recomputed + gathered
        if rank == last:
            other += logits
        if rank in (0, last):
            other += edge
        cache = 0.0
        if not job.cluster.cpu:
            cache = ALLOCATOR_FRAGMENTATION * (mine * (weight_b + grad_b + optim_b) + acts + other)
        memory = Memory(
            params=mine * weight_b,
            grads=mine * grad_b,
            optimizer=mine * optim_b,
            activations=acts,
            other=other,
            fragmentation=cache,
            reserve=reserve,
        )
        out.append(memory)
    return out


def peak_memory(job: Job) -> tuple[int, Memory]:
    """The pipeline rank whose tensors take the most memory, and its memory."""
    ranks = rank_shapes(job.model, job.layout.pp, job.par.virtual_stages)[2]
    return max(zip(ranks, rank_memories(job, ranks)), key=lambda rm: rm[1].total)
