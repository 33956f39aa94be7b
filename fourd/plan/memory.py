"""Memory per GPU: weights, gradients and optimizer state by ZeRO stage, activations per layer for the block
type and recomputation, microbatches in flight per pipeline schedule, embedding and logits.

All sizes in bytes unless a name says otherwise. Pure functions, tested against brief.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fourd.layout import layer_split

GB = 1e9


# ---- whole-model arithmetic (brief.md §1, rows 01-02) --------------------------------------------------


def weights_bytes(params: float, bytes_per_param: int = 2) -> float:
    """405e9 BF16 parameters are 810 GB."""
    return params * bytes_per_param


def training_state_bytes(params: float, zero: int = 0, dp: int = 1, dtype_bytes: int = 2) -> float:
    """Weights + gradients + optimizer state of mixed-precision Adam: 16 B/param unsharded (405B: 6.48 TB)."""
    return params * sum(state_bytes_per_param(zero, dp, dtype_bytes))


def min_gpus(nbytes: float, gpu_memory_gb: float) -> int:
    """Fewest GPUs whose memory holds nbytes, before activations (6.48 TB on 80 GB: 81)."""
    return -int(-nbytes // (gpu_memory_gb * GB))


def state_bytes_per_param(zero: int, dp: int, dtype_bytes: int = 2) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter for ZeRO stage 0-3 over dp ranks (Rajbhandari et al.
    2020, §5): mixed precision keeps 16-bit weights and gradients and an FP32 master copy, momentum and
    variance (2 + 2 + 12 = 16: stage 1 4 + 12/N_d, stage 2 2 + 14/N_d, stage 3 16/N_d). FP32 training keeps
    4 + 4 + 8 (no master copy)."""
    w = g = dtype_bytes
    opt = 12 if dtype_bytes == 2 else 8
    if zero == 0:
        return w, g, opt
    if zero == 1:
        return w, g, opt / dp
    if zero == 2:
        return w, g / dp, opt / dp
    if zero == 3:
        return w / dp, g / dp, opt / dp
    raise ValueError(f"ZeRO stage {zero} is not 0-3")


# ---- parameters on each pipeline stage ---------------------------------------------------------------


def stage_layers(layers: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Transformer layers of each of the pp·V pipeline stages: the trainer's split
    (fourd.layout.layer_split), and beyond the trainer, the first and last stage may hold only
    the embedding and the output when layers + 2 = pp·V (405B: 128 stages of one layer)."""
    return layer_split(layers, pp * virtual_stages, empty_edges=True)


def stage_params(model, counts: list[int], stage: int) -> int:
    """Parameters of one pipeline stage (whole, before TP)."""
    p = counts[stage] * model.layer_params()
    if stage == 0:
        p += model.embedding_params()
    if stage == len(counts) - 1:
        p += model.embedding_params() + (model.dim if model.mlp == "swiglu" else 2 * model.dim)
    return p


# ---- activations ---------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def activation_bytes_per_token(
    model, tp: int = 1, recompute: str = "none", sequence_parallel: bool = True, dtype_bytes: int = 2
) -> float:
    """Bytes one layer keeps for backward per token on one TP rank, with a fused (flash) attention kernel.

    Derived for these blocks the way Korthikanti et al. 2022 (§4.1) derive 34·sbh for GPT: a pre-norm
    block saves the inputs of both norms (h each) and their outputs (h each, the inputs of the QKV and
    MLP GEMMs); attention saves Q, K, V and its output (GQA: K and V have kv_heads) and a logsumexp per
    head (4 B); the MLP saves the inputs of its nonlinearity and of its last GEMM (SwiGLU: w1 and w3
    outputs and their product, 3·ffn; GeLU: 2·ffn). No dropout. Sequence parallelism cuts the norm
    parts by tp; TP cuts the rest.
    - selective: norm outputs and the MLP product are recomputed from what is kept (cheap elementwise).
    - full: only the layer input is kept (the layer is recomputed in backward).
    """
    b = dtype_bytes
    h, hd = model.dim, model.head_dim
    norm_cut = tp if sequence_parallel else 1
    if recompute == "full":
        return h * b / norm_cut
    q = model.heads * hd
    kv = 2 * model.kv_heads * hd
    mlp = (3 if model.mlp == "swiglu" else 2) * model.ffn
    norms = 4 * h
    if recompute == "selective":
        norms, mlp = 2 * h, mlp - model.ffn
    attention = q + kv + q  # Q, K, V, output
    return norms * b / norm_cut + (attention + mlp) * b / tp + 4 * model.heads / tp


def gpt_activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, flash: bool = False
) -> float:
    """Korthikanti et al. 2022 eq. 1-4 (16-bit GPT layer with dropout): sbh(34 + 5as/h) with no parallelism,
    sbh(10 + 24/t + 5as/(ht)) with TP, (sbh/t)(34 + 5as/h) with TP and SP; flash attention drops the 5as/h."""
    scores = 0 if flash else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + scores)
    return s * b * h * (10 + 24 / t + scores / t)


def in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int, rank: int) -> float:
    """Microbatches whose activations pipeline rank `rank` holds at its peak, in units of all its layers
    (the closed forms of fourd.schedules' action lists, which the tests check against).

    GPipe: all m (every forward before any backward). 1F1B: p − rank (Narayanan et al. 2021 §2.2). ZB-H1:
    p on every rank, its deferred weight gradients keeping inputs alive (Qi et al. 2023 §3.1). Interleaved:
    (V − 1)·R + 2(p − rank − 1) warm-up forwards of one stage (1/V of the layers) each and one more, R the
    first round of microbatches (at least p; fourd.schedules)."""
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


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    other: float  # logits of the loss, gathered ZeRO-3 buffers
    reserve: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def gb(self) -> dict:
        return {
            "params": self.params / GB,
            "grads": self.grads / GB,
            "optimizer": self.optimizer / GB,
            "activations": self.activations / GB,
            "other": self.other / GB,
            "reserve": self.reserve / GB,
            "total": self.total / GB,
        }


@lru_cache(maxsize=4096)
def rank_shapes(model, pp: int, virtual_stages: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """(layers per pipeline rank, parameters per pipeline rank before TP, the ranks that can peak in memory,
    parameters of the largest stage).

    In-flight microbatches fall with the rank, so besides the last (logits) only the first rank with each
    layer count can hold the most."""
    counts = stage_layers(model.layers, pp, virtual_stages)
    layers = tuple(sum(counts[s] for s in range(r, len(counts), pp)) for r in range(pp))
    params = tuple(sum(stage_params(model, counts, s) for s in range(r, len(counts), pp)) for r in range(pp))
    first_with: dict[int, int] = {}
    for r, n in enumerate(layers):
        first_with.setdefault(n, r)
    biggest = max(stage_params(model, counts, s) for s in range(len(counts)))
    return layers, params, tuple(sorted({0, pp - 1, *first_with.values()})), biggest


def rank_memory(
    model,
    cluster,
    layout,
    seq: int,
    micro_seqs: int,
    schedule: str,
    microbatches: int,
    virtual_stages: int,
    zero: int,
    recompute: str,
    rank: int,
    sequence_parallel: bool = True,
) -> Memory:
    """Peak memory of one GPU of pipeline rank `rank`."""
    b = cluster.dtype_bytes
    layers, params, _, biggest = rank_shapes(model, layout.pp, virtual_stages)
    mine = params[rank] / layout.tp
    w, g, o = state_bytes_per_param(zero, layout.cp * layout.dp, b)  # FSDP shards over dp×cp
    tokens = micro_seqs * seq // layout.cp
    per_layer = tokens * activation_bytes_per_token(model, layout.tp, recompute, sequence_parallel, b)
    acts = in_flight(schedule, layout.pp, microbatches, virtual_stages, rank) * layers[rank] * per_layer
    other = 0.0
    if recompute == "full":
        # the layer being recomputed holds its whole activations for one microbatch
        other += tokens * activation_bytes_per_token(model, layout.tp, "none", sequence_parallel, b)
    if rank == layout.pp - 1:
        # FP32 logits and their gradient for one microbatch, vocabulary split over TP
        other += 2 * 4 * tokens * model.vocab / layout.tp
    if zero == 3:
        # one gathered stage and the next, prefetched
        other += 2 * biggest / layout.tp * b
    return Memory(mine * w, mine * g, mine * o, acts, other, cluster.gpu.memory_reserve_gb * GB)


def peak_memory(
    model,
    cluster,
    layout,
    seq,
    micro_seqs,
    schedule,
    microbatches,
    virtual_stages,
    zero,
    recompute,
    sequence_parallel: bool = True,
) -> Memory:
    """The pipeline rank with the most memory."""
    _, fullest = fullest_rank(
        model,
        cluster,
        layout,
        seq,
        micro_seqs,
        schedule,
        microbatches,
        virtual_stages,
        zero,
        recompute,
        sequence_parallel,
    )
    return rank_memory(
        model,
        cluster,
        layout,
        seq,
        micro_seqs,
        schedule,
        microbatches,
        virtual_stages,
        zero,
        recompute,
        fullest,
        sequence_parallel,
    )


def fullest_rank(
    model,
    cluster,
    layout,
    seq,
    micro_seqs,
    schedule,
    microbatches,
    virtual_stages,
    zero,
    recompute,
    sequence_parallel: bool = True,
) -> tuple[float, int]:
    """(bytes, pipeline rank) of the GPU with the most memory, the reserve included: the quick form of
    peak_memory that the search asks many times."""
    layers, params, ranks, biggest = rank_shapes(model, layout.pp, virtual_stages)
    b = cluster.dtype_bytes
    per_param = sum(state_bytes_per_param(zero, layout.cp * layout.dp, b)) / layout.tp
    tokens = micro_seqs * seq // layout.cp
    per_layer = tokens * activation_bytes_per_token(model, layout.tp, recompute, sequence_parallel, b)
    logits = 8 * tokens * model.vocab / layout.tp
    common = cluster.gpu.memory_reserve_gb * GB
    if recompute == "full":
        common += tokens * activation_bytes_per_token(model, layout.tp, "none", sequence_parallel, b)
    if zero == 3:
        common += 2 * biggest / layout.tp * b
    return max(
        (
            params[r] * per_param
            + logits * (r == layout.pp - 1)
            + common
            + per_layer * layers[r] * in_flight(schedule, layout.pp, microbatches, virtual_stages, r),
            r,
        )
        for r in ranks
    )


def max_rank_params(model, pp: int, virtual_stages: int, tp: int) -> float:
    """Parameters on the GPU that holds the most (what its data-parallel collectives move)."""
    return max(rank_shapes(model, pp, virtual_stages)[1]) / tp
