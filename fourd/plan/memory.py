"""Memory per GPU, bytes: weights, gradients and optimizer state by ZeRO stage, the activations a
layer keeps times the schedule's microbatches in flight, the logits, FSDP's gathered layers, the
allocator's cache, the runtime (docs/planner.md derives each term)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from fourd.plan.block import loss_bytes, traffic
from fourd.plan.job import Job, Work, stage_layers

GB = 1e9
# Memory.room's classes, best first
ROOMY = 0  # fits with the allocator's cache
TIGHT = 1  # fits only by emptying the cache
OVERFLOWS = 2  # does not fit
# PyTorch's CUDA caching allocator keeps freed blocks for reuse: reserved over allocated, less one.
# Fitted. (Its CPU allocator returns freed memory to malloc: nothing on CPU profiles.)
ALLOCATOR_FRAGMENTATION = 0.1952
# FP8 training: bytes per linear-layer weight of its FP8 copy and that copy transposed (Transformer
# Engine caches both across a step's microbatches)
FP8_WEIGHT_COPIES = 2


def state_bytes_per_param(
    zero: int, dp: int, dtype_bytes: int = 2, grad_bytes: int | None = None
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter for ZeRO stage 0-3 over dp ranks: 2 + 2 +
    12 in mixed precision, 4 + 4 + 8 in FP32 (Rajbhandari et al. 2020 §5); `grad_bytes`, where the
    gradients are held in other bytes than the weights (Job.grad_bytes)."""
    w = dtype_bytes
    g = dtype_bytes if grad_bytes is None else grad_bytes
    opt = 12 if dtype_bytes == 2 else 8
    return (w / dp if zero >= 3 else w, g / dp if zero >= 2 else g, opt / dp if zero >= 1 else opt)


def stage_params(model, counts: list[int], stage: int) -> int:
    """Parameters of one pipeline stage (whole, before TP): its layers, the input embedding on the
    first, the final norm and the output projection on the last. A tied output projection is the
    embedding's matrix where one stage holds both; across a pipeline the last stage holds a copy
    of it (Megatron's word embeddings on the last stage, their gradients all-reduced with the
    first's)."""
    params = counts[stage] * model.layer_params()
    if stage == 0:
        params += model.embedding_params()
    if stage == len(counts) - 1:
        params += model.final_norm_params()
        if not (model.tied_embeddings and len(counts) == 1):
            params += model.embedding_params()
    return params


@lru_cache(maxsize=4096)
def rank_shapes(
    model, pp: int, virtual_stages: int, split: str = "layers"
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(layers per pipeline rank, parameters per pipeline rank before TP, the ranks that can peak in
    memory: in-flight microbatches fall with the rank, so besides the last (logits) the first with
    each layer count), the layers split as the stack splits them (`split`: job.stage_layers)."""
    counts = stage_layers(model, pp, virtual_stages, split)
    layers = tuple(
        sum(counts[stage] for stage in range(rank, len(counts), pp)) for rank in range(pp)
    )
    params = tuple(
        sum(stage_params(model, counts, stage) for stage in range(rank, len(counts), pp))
        for rank in range(pp)
    )
    first_with = {count: rank for rank, count in reversed(list(enumerate(layers)))}
    return layers, params, tuple(sorted({0, pp - 1, *first_with.values()}))


def max_rank_params(model, pp: int, virtual_stages: int, tp: int, split: str = "layers") -> float:
    """Parameters on the GPU that holds the most (what its data-parallel collectives move)."""
    return max(rank_shapes(model, pp, virtual_stages, split)[1]) / tp


def in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int, rank: int) -> float:
    """Microbatches whose activations pipeline rank `rank` holds at its peak, in units of all its
    layers: the closed forms of fourd.schedules' lists (docs/simulators.md's "peak in flight"; the
    tests check them)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - rank, microbatches)
    if schedule == "zero-bubble":
        return min(pp, microbatches)
    rounds = max(1, microbatches // pp)
    first_round = -(-microbatches // rounds)
    return (
        min(
            microbatches * virtual_stages,
            (virtual_stages - 1) * first_round + 2 * (pp - rank - 1) + 1,
        )
        / virtual_stages
    )


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    other: float  # logits of the loss, gathered ZeRO-3 buffers, autocast's BF16 weight copies
    fragmentation: float  # what the caching allocator keeps reserved beyond the tensors
    reserve: float  # the runtime's: CUDA context, NCCL's buffers

    @property
    def states(self) -> float:
        """Bytes of the weights, their gradients and the optimizer's state: what no recomputation
        frees."""
        return self.params + self.grads + self.optimizer

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

    def fits_with_cache(self, capacity: float) -> bool:
        """All it holds fits, the allocator's cache included: no allocation has to wait for the
        allocator to free its cached blocks and retry."""
        return self.held <= capacity

    def room(self, capacity: float) -> int:
        """How a configuration sits in `capacity`, best first: ROOMY (it fits with the allocator's
        cache), TIGHT (it fits only by emptying the cache: PyTorch's caching allocator frees its
        cached blocks and retries the allocation, synchronising the device, `num_alloc_retries` in
        torch.cuda.memory_stats; the step slows by what the model does not count) or OVERFLOWS."""
        if self.fits_with_cache(capacity):
            return ROOMY
        return TIGHT if self.fits(capacity) else OVERFLOWS

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


def rank_state_bytes(job: Job) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter on one GPU: state_bytes_per_param over
    the ranks FSDP shards over (dp × cp, or an HSDP group); under autocast the weights and their
    gradients are FP32, as in FP32 training (Job.state_dtype_bytes); the gradients in the bytes the
    stack holds them in (Job.grad_bytes)."""
    return state_bytes_per_param(
        job.par.zero, job.par.shard_ranks, job.state_dtype_bytes, job.grad_bytes
    )


@lru_cache(maxsize=4096)
def recomputed_bytes_per_token(work: Work) -> float:
    """Per token, what a recomputed layer's recomputation makes again and holds through its
    backward: all it would keep without recomputation, less what it kept; 0 without recomputation."""
    if work.recompute == "none":
        return 0.0
    return traffic(replace(work, recompute="none")).saved - traffic(work).saved


class RankTerms(NamedTuple):
    """What one job's memory per GPU is made of before the pipeline rank is known (a rank's memory
    adds up from these): bytes per parameter of the weights, gradients and optimizer state it
    holds; per layer, the activations kept for one microbatch and autocast's or FP8's weight
    copies; a recomputed layer's working set and FSDP's gathered layers, on every rank; the
    embedding and output layer gathered, on the first and last ranks; the loss's logits and
    autocast's copy of the output projection, on the last rank."""

    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activations_per_layer: float
    copies_per_layer: float
    recomputed: float
    gathered: float
    edge_ranks: float
    last_rank: float


def rank_terms(job: Job) -> RankTerms:
    """The terms of each pipeline rank's memory for `job`."""
    lay, work, b, model = job.layout, job.work, job.dtype_bytes, job.model
    weight_bytes, grad_bytes, optimizer_bytes = rank_state_bytes(job)
    # while a recomputed layer runs its backward it holds, for one microbatch, the activations its
    # recomputation made again: all it would keep without recomputation, less what it kept
    recomputed = work.tokens * recomputed_bytes_per_token(work)
    logits = loss_bytes(b)[2] * work.tokens * model.vocab / lay.tp  # the loss's, one microbatch
    # BF16 autocast over FP32 weights casts each weight matrix to BF16 once per autocast region (one
    # a microbatch, or one around a pipeline's schedule) and the matmul keeps the copy for its
    # backward: a rank holds one copy of its layers' matrices and the output projection's
    copies_per_layer = model.layer_matrix_params() / lay.tp * b if work.autocast else 0.0
    if work.fp8 and job.par.zero < 3:
        # Transformer Engine keeps each linear weight a rank holds whole in FP8 and transposed, 1 + 1
        # B, for the step; sharded by ZeRO 3, a layer's FP8 weights live while it is gathered
        copies_per_layer += model.layer_matrix_params() / lay.tp * FP8_WEIGHT_COPIES
    head_copy = model.embedding_params() / lay.tp * b if work.autocast else 0.0
    gathered = edge = 0.0
    if job.par.zero == 3:
        layer = model.layer_params()
        gathered = 2 * layer / lay.tp * b  # FSDP's gathered layer and the next
        edge = 2 * max(0, model.embedding_params() - layer) / lay.tp * b  # embedding, output
    return RankTerms(
        weight_bytes,
        grad_bytes,
        optimizer_bytes,
        work.tokens * traffic(work).saved,
        copies_per_layer,
        recomputed,
        gathered,
        edge,
        logits + head_copy,
    )


class RankBytes(NamedTuple):
    """One pipeline rank's bytes, Memory's fields before the runtime's reserve."""

    params: float
    grads: float
    optimizer: float
    activations: float
    other: float
    fragmentation: float

    @property
    def tensors(self) -> float:
        """Bytes of tensors at the peak, summed as Memory.total sums them (the same order, so the
        same float)."""
        return self.params + self.grads + self.optimizer + self.activations + self.other


def _rank_bytes(job: Job, terms: RankTerms, shapes, rank: int) -> RankBytes:
    """One pipeline rank's bytes: its parameters' states, its layers' activations times the
    microbatches it holds in flight, the rest by its place in the pipeline, and the allocator's
    cache over all of them (none on CPU profiles). `shapes`: rank_shapes of the job."""
    par, lay = job.par, job.layout
    layers, params, _ = shapes
    mine = params[rank] / lay.tp
    flight = in_flight(par.schedule, lay.pp, par.microbatches, par.virtual_stages, rank)
    acts = flight * layers[rank] * terms.activations_per_layer
    other = terms.recomputed + layers[rank] * terms.copies_per_layer
    if rank == lay.pp - 1:
        other += terms.last_rank
    other += terms.gathered
    if rank in (0, lay.pp - 1):
        other += terms.edge_ranks
    states = mine * (terms.weight_bytes + terms.grad_bytes + terms.optimizer_bytes)
    cache = 0.0 if job.cluster.cpu else ALLOCATOR_FRAGMENTATION * (states + acts + other)
    return RankBytes(
        params=mine * terms.weight_bytes,
        grads=mine * terms.grad_bytes,
        optimizer=mine * terms.optimizer_bytes,
        activations=acts,
        other=other,
        fragmentation=cache,
    )


def _shapes(job: Job):
    """rank_shapes of `job`: its pipeline ranks' layers and parameters, and the ranks that can peak."""
    return rank_shapes(job.model, job.layout.pp, job.par.virtual_stages, job.work.pipeline_split)


def rank_memories(job: Job, ranks) -> list[Memory]:
    """Peak memory of one GPU of each pipeline rank in `ranks`."""
    terms, shapes, reserve = rank_terms(job), _shapes(job), job.cluster.gpu.memory_reserve_gb * GB
    return [Memory(*_rank_bytes(job, terms, shapes, rank), reserve) for rank in ranks]


def peak_memory(job: Job) -> tuple[int, Memory]:
    """The pipeline rank whose tensors take the most memory, and its memory (the ranks compared
    by their tensors' bytes, Memory.total, as sums of the same terms in the same order)."""
    terms, shapes = rank_terms(job), _shapes(job)
    _, _, ranks = shapes
    per_rank = [(rank, _rank_bytes(job, terms, shapes, rank)) for rank in ranks]
    rank, peak = max(per_rank, key=lambda rank_bytes: rank_bytes[1].tensors)
    return rank, Memory(*peak, job.cluster.gpu.memory_reserve_gb * GB)
