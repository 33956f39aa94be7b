"""Plans and the search: one configuration evaluated (memory, time, MFU), and every valid
configuration for N GPUs ranked by tokens/s among those that fit."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from fourd.errors import FourdError
from fourd.layout import RECOMPUTE, Layout, Parallelism, split_ok, tp_ok
from fourd.layout import check as layout_check
from fourd.plan.block import matmuls
from fourd.plan.cluster import group_level
from fourd.plan.job import Job
from fourd.plan.memory import GB, OVERFLOWS, ROOMY, TIGHT, Memory, peak_memory
from fourd.plan.perf import StepTime, step_floor, step_time
from fourd.plan.stack import Stack, load_stack

MICRO_SEQS = (1, 2, 4, 8, 16)  # sequences per microbatch the search tries
MIN_CP_TOKENS = (
    1024  # the search splits a sequence over CP ranks only down to this many tokens each
)


# The settings a user pinned, by Parallelism's field names; None leaves one to the planner (fastest
# that fits).
OPEN = ("layout", "schedule", "virtual_stages", "microbatches", "zero", "recompute")
# StepTime's terms (fields `<term>_s`) in a plan's JSON breakdown_s, seconds
BREAKDOWN = (
    "compute",
    "tp_comm",
    "cp_comm",
    "bubble",
    "p2p",
    "dp_exposed",
    "dp_total",
    "overlap",
    "optimizer",
)


def _stack_json(job: Job) -> dict:
    """The plan's software as planned (`fourd plan --json`): compile, attention, the stack and its
    switches."""
    return {
        "compiled": job.compiled,
        "attention": job.attention,
        "stack": job.stack,
        "tp_overlap": job.work.tp_overlap,
        "dp_overlap": job.dp_overlapped,
        "fused_kernels": job.work.fused,
        "fused_attention": job.work.fused_attention,
        "gather_in_step": job.gathers_in_step,
        "autocast": job.work.autocast,
        "grad_reduce_bytes": job.grad_reduce_bytes,
        "grad_bytes": job.grad_bytes,
        "shard_reduce": job.shard_reduce,
        "weight_gather": job.weight_gather,
        "selective": job.work.selective,
    }


@dataclass(frozen=True)
class Plan:
    job: Job
    step: StepTime
    memory: Memory
    chosen: tuple[str, ...] = field(
        default=()
    )  # settings the planner chose because the user left them open

    config = property(lambda self: self.job.par)
    model = property(lambda self: self.job.model)
    cluster = property(lambda self: self.job.cluster)
    seq = property(lambda self: self.job.seq)
    global_seqs = property(lambda self: self.job.global_seqs)
    micro_seqs = property(lambda self: self.job.micro_seqs)
    gpus = property(lambda self: self.job.layout.world)
    fits = property(lambda self: self.memory.fits(self.cluster.gpu.memory_gb * GB))
    fits_with_cache = property(
        lambda self: self.memory.fits_with_cache(self.cluster.gpu.memory_gb * GB)
    )
    room = property(lambda self: self.memory.room(self.cluster.gpu.memory_gb * GB))

    @property
    def peak_gb(self) -> float:
        """Peak memory per GPU: tensors and the runtime's reserve (what must fit), GB."""
        return (self.memory.total + self.memory.reserve) / GB

    tokens_per_s = property(lambda self: self.global_seqs * self.seq / self.step.step_s)
    mfu = property(lambda self: self.tflops_per_gpu / self.peak_tflops)

    @property
    def peak_tflops(self) -> float:
        """The GPU's dense peak in the precision its GEMMs run in, MFU's denominator: FP8 training
        against the FP8 peak (as NVIDIA's and MegaScale's MFU count it), else the profile's."""
        gpu = self.cluster.gpu
        return gpu.fp8_peak_tflops if self.job.fp8 and gpu.fp8_peak_tflops else gpu.peak_tflops

    bubble_fraction = property(lambda self: self.step.bubble_s / self.step.step_s)

    @property
    def model_flops(self) -> float:
        """FLOPs of one step: 6·(N − input embedding) + 12·L·H·Q·T per token (PaLM appendix B, as
        Megatron counts)."""
        return self.global_seqs * self.seq * self.model.flops_per_token(self.seq)

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step.step_s / self.gpus / 1e12

    @property
    def hw_tflops_per_gpu(self) -> float:
        """Model FLOPs and the recomputed forward's (docs/planner.md says what each mode redoes)."""
        model, work, rc = self.model, self.job.work, self.config.recompute
        attention = model.attention_forward_flops_per_token(self.seq)
        mm = [2 * out_dim * k * work.layout.tp * model.layers for out_dim, k in matmuls(work)]
        extra = {"full": sum(mm) + attention, "per-op": sum(mm[1::2])}.get(rc, 0.0)
        if work.recomputes_attention:
            extra += attention
        return self.tflops_per_gpu * (1 + extra / model.flops_per_token(self.seq))

    def to_json(self, train_tokens: float | None = None) -> dict:
        config, step, lay, job = self.config, self.step, self.config.layout, self.job
        out = {"model": self.model.to_dict(), "cluster": self.cluster.name, "gpus": self.gpus}
        out |= {"dtype": job.precision or self.cluster.dtype} | _stack_json(job)
        out |= {
            "pipeline_comm": job.pipeline_comm,
            "layout": {dim: getattr(lay, dim) for dim in ("tp", "cp", "pp", "dp")},
        }
        out |= {
            k: getattr(config, k)
            for k in ("schedule", "microbatches", "virtual_stages", "zero", "recompute")
        }
        out |= {"sequence_parallel": config.sequence_parallel}
        out |= {
            "hsdp_replicas": config.hsdp_replicas,
            "micro_batch_seqs": self.micro_seqs,
            "seq": self.seq,
        }
        out |= {
            "global_batch_tokens": self.global_seqs * self.seq,
            "fits": self.fits,
            "step_time_s": step.step_s,
        }
        out |= {"memory_gb": {k: round(gb, 3) for k, gb in self.memory.gb().items()}}
        out |= {"memory_capacity_gb": self.cluster.gpu.memory_gb, "tokens_per_s": self.tokens_per_s}
        out |= {
            k: getattr(self, k)
            for k in (
                "tflops_per_gpu",
                "hw_tflops_per_gpu",
                "mfu",
                "peak_tflops",
                "bubble_fraction",
            )
        }
        out["breakdown_s"] = {term: getattr(step, f"{term}_s") for term in BREAKDOWN}
        out["rank_order"] = job.work.rank_order
        out["placement"] = {
            dim: group_level(group, self.cluster) for dim, group in job.work.groups.items()
        }
        out["stage_layers"] = self.job.stage_layers
        out["chosen_by_planner"] = list(self.chosen)
        if train_tokens:
            out |= {
                "train_tokens": train_tokens,
                "training_days": train_tokens / self.tokens_per_s / 86400,
            }
        return out


def evaluate(job: Job, chosen=()) -> Plan:
    """The plan of one configuration (valid by fourd.layout.check)."""
    return Plan(job, step_time(job), peak_memory(job)[1], tuple(chosen))


# ---- the search ----------------------------------------------------------------------------------


def _divisors(number: int) -> list[int]:
    small = [divisor for divisor in range(1, math.isqrt(number) + 1) if number % divisor == 0]
    return sorted(set(small + [number // divisor for divisor in small]))


def layouts(model, gpus: int, seq: int, global_seqs: int) -> list[Layout]:
    """Every (tp, cp, pp, dp) with tp·cp·pp·dp = gpus that splits the model, the sequence and the
    batch."""
    out = []
    for tp in (tp_degree for tp_degree in _divisors(gpus) if tp_ok(model, tp_degree)):
        for cp in (
            cp_degree
            for cp_degree in _divisors(gpus // tp)
            if seq % (2 * cp_degree) == 0 and (cp_degree == 1 or seq // cp_degree >= MIN_CP_TOKENS)
        ):
            for pp in (
                pp_degree
                for pp_degree in _divisors(gpus // (tp * cp))
                if split_ok(model.layers, pp_degree)
            ):
                if global_seqs % (gpus // (tp * cp * pp)) == 0:
                    out.append(Layout(tp, cp, pp, gpus // (tp * cp * pp)))
    return out


def _virtual_stages(layers: int, pp: int) -> list[int]:
    """V values that split the layers cleanly: every stage the same, or first and last one fewer."""
    top = (layers + 2) // pp + 1
    return [
        stages
        for stages in range(2, top)
        if split_ok(layers, pp * stages)
        and 0 in (layers % (pp * stages), (layers + 2) % (pp * stages))
    ]


def _schedules(pinned: str | None, pp: int, stack: Stack) -> list[str]:
    """The schedules to try: the pinned one; without a pipeline 1F1B (every schedule is the same);
    else the stack's, GPipe only when the stack has nothing else (1F1B's bubble, more memory)."""
    if pinned:
        return [pinned]
    if pp == 1:
        return ["1f1b"]
    better = [name for name in stack.schedules if name != "gpipe"]
    return better or list(stack.schedules)


def _zero_stages(pinned: int | None, lay: Layout, hsdp_replicas: int, stack: Stack) -> list[int]:
    """The ZeRO stages to try: the pinned one; with HSDP and no stage pinned 3 (FSDP's HSDP; ZeRO 1
    and 2 within replica groups only when pinned);
    unsharded, 0 (every stage is the same); else the stack's sharded stages, ZeRO 0 only when it
    has no other (ZeRO 1 moves fewer bytes and shards the optimizer)."""
    if pinned is not None:
        return [pinned]
    if hsdp_replicas > 1:
        return [3]
    if lay.cp * lay.dp == 1:
        return [0]
    runs = stack.zero_stages(lay.pp)
    return [stage for stage in runs if stage > 0] or list(runs) or [0]


def configs(model, gpus: int, seq: int, global_seqs: int, fixed: dict, stack: Stack):
    """Every Parallelism the fixed settings allow, recomputation "none" (see `search`); settings
    left open keep to what `stack` runs (its model-parallel dimensions, schedules and ZeRO
    stages)."""
    seq_parallel = fixed["sequence_parallel"]
    candidates = [fixed["layout"]] if fixed["layout"] else layouts(model, gpus, seq, global_seqs)
    for lay in candidates:
        if not fixed["layout"] and not stack.runs_layout(lay):
            continue
        per_replica = global_seqs // lay.dp
        counts = [per_replica // seqs for seqs in MICRO_SEQS if per_replica % seqs == 0]
        if fixed["microbatches"]:
            counts = [fixed["microbatches"]] if per_replica % fixed["microbatches"] == 0 else []
        for sched in _schedules(fixed["schedule"], lay.pp, stack):
            if seq_parallel and (seq // lay.cp) % lay.tp:
                continue
            zeros = _zero_stages(fixed["zero"], lay, fixed["hsdp_replicas"], stack)
            stage_counts = [fixed["virtual_stages"] or 1] if lay.pp == 1 else [1]
            if sched == "interleaved" and lay.pp > 1:
                stage_counts = (
                    [fixed["virtual_stages"]]
                    if fixed["virtual_stages"]
                    else _virtual_stages(model.layers, lay.pp)
                )
            # interleaving fewer microbatches than ranks idles most of the time: only when nothing
            # else is left
            few = sched == "interleaved" and max(counts, default=0) >= lay.pp
            micro_counts = [micro for micro in counts if micro >= lay.pp or not few]
            hsdp = fixed["hsdp_replicas"]
            yield from (
                Parallelism(
                    layout=lay,
                    schedule=sched,
                    microbatches=micro,
                    virtual_stages=virtual,
                    zero=zero,
                    recompute="none",
                    sequence_parallel=seq_parallel,
                    hsdp_replicas=hsdp,
                )
                for virtual in stage_counts
                for micro in micro_counts
                for zero in zeros
            )


def valid(job: Job) -> bool:
    """Whether fourd.layout.check lets the job run (the search skips what pinned settings rule
    out)."""
    try:
        layout_check(job.model, job.par, job.seq, job.global_seqs)
    except FourdError:
        return False
    return True


def _lightest_recompute(job: Job, modes: list[str], capacity: float) -> tuple[Job, Memory]:
    """`job` at the first recomputation mode of `modes` whose peak memory fits `capacity` with the
    allocator's cache (Memory.room ROOMY), else at the first that fits by emptying the cache, else
    at the last, and that memory. Where the weights, gradients and optimizer state of the fullest
    rank alone overflow, no mode fits (recomputation frees activations only, and the peak rank holds
    at least those states): the last mode is taken without trying the ones between."""
    tight = None  # the first mode that fits only by emptying the cache
    for index, recompute in enumerate(modes):
        if recompute != job.par.recompute:
            job = replace(job, par=replace(job.par, recompute=recompute))
        memory = peak_memory(job)[1]
        room = memory.room(capacity)
        if room == ROOMY:
            return job, memory
        if room == TIGHT and tight is None:
            tight = job, memory
        if memory.states + memory.reserve > capacity and index < len(modes) - 1:
            job = replace(job, par=replace(job.par, recompute=modes[-1]))
            return job, peak_memory(job)[1]
    return tight or (job, memory)


@dataclass(frozen=True)
class Ranking:
    """What a search found: its best plans in the search's order (`ranked`; as many as it was
    asked for, or every one), the configurations it tried and how many of them fit."""

    plans: list[Plan]
    searched: int
    fitting: int

    @classmethod
    def of(cls, plans: list[Plan], top: int | None = None) -> Ranking:
        """The ranking of a search's every plan (in order), listing the first `top` of them."""
        return cls(plans[:top], len(plans), sum(plan.fits for plan in plans))


def ranked(plan: Plan) -> tuple:
    """The search's order: plans that fit with the allocator's cache, fastest first; then those
    that fit only by emptying it (its retries slow a step by more than the model counts), fastest
    first; those that do not fit, smallest first."""
    return (plan.room, -plan.tokens_per_s if plan.fits else plan.memory.total)


def search(base: Job, gpus: int, fixed: dict, chosen=()) -> list[Plan]:
    """Plans for every configuration of `gpus` GPUs for `base`'s model, cluster, sequence and batch
    (its own Parallelism is ignored), in the search's order (`ranked`). Recomputation, when left
    open, is the lightest that fits with the allocator's cache, else the lightest that fits
    (RECOMPUTE's order, _lightest_recompute): each costs time and saves memory."""
    return rank(base, gpus, fixed, chosen).plans


def rank(base: Job, gpus: int, fixed: dict, chosen=(), top: int | None = None) -> Ranking:
    """`search`'s ranking, its first `top` plans only when `top` is given: the same plans in the
    same order as the first `top` of every plan, found without timing every configuration. Each
    configuration's memory is computed (whether it fits decides its place), but a fitting one is
    timed in full only while its step_floor could still place it among the `top` fastest."""
    sized, capacity = [], base.cluster.gpu.memory_gb * GB
    pinned = (
        any(fixed[k] is not None for k in OPEN) or fixed["hsdp_replicas"] > 1
    )  # else every config is valid
    stack = load_stack(base.stack)
    modes = [fixed["recompute"]] if fixed["recompute"] else list(RECOMPUTE)
    for par in configs(base.model, gpus, base.seq, base.global_seqs, fixed, stack):
        job = replace(base, par=par)
        if pinned and not valid(job):
            continue
        sized.append(_lightest_recompute(job, modes, capacity))
    by_room: dict[int, list[tuple[Job, Memory]]] = {ROOMY: [], TIGHT: [], OVERFLOWS: []}
    for job, memory in sized:
        by_room[memory.room(capacity)].append((job, memory))
    roomy, tight, too_big = by_room[ROOMY], by_room[TIGHT], by_room[OVERFLOWS]
    fitting = len(roomy) + len(tight)
    if top is None:
        plans = [Plan(job, step_time(job), memory, tuple(chosen)) for job, memory in sized]
        return Ranking(sorted(plans, key=ranked), len(sized), fitting)
    plans = _fastest(roomy, top, chosen)
    if len(plans) < top:  # too few fit with the cache: the fastest of those that fit without it
        plans += _fastest(tight, top - len(plans), chosen)
    if len(plans) < top:  # too few fit: the smallest of the rest follow, and only they are timed
        smallest = sorted(too_big, key=lambda pair: pair[1].total)[: top - len(plans)]
        plans += [Plan(job, step_time(job), memory, tuple(chosen)) for job, memory in smallest]
    return Ranking(plans, len(sized), fitting)


def _fastest(fitting: list[tuple[Job, Memory]], top: int, chosen) -> list[Plan]:
    """The `top` fastest plans of the fitting (job, memory) pairs, in the search's order (ties in
    the order the configurations came). Jobs are timed in the order of their step_floor; once the
    `top`-th fastest so far runs more tokens a second than the next floor allows, no job left can
    join them (its step is at least its floor), and none is timed."""
    if not fitting:
        return []
    first_job, _ = fitting[0]
    tokens = first_job.global_seqs * first_job.seq  # per step, the same for every job
    floors = [step_floor(job) for job, _ in fitting]
    timed: list[tuple[int, Plan]] = []
    fastest: list[float] = []  # tokens/s of the `top` fastest timed so far, a min-heap
    for index in sorted(range(len(fitting)), key=floors.__getitem__):
        ceiling = tokens / floors[index] if floors[index] > 0 else math.inf
        if len(fastest) == top and ceiling < fastest[0]:
            break
        job, memory = fitting[index]
        plan = Plan(job, step_time(job), memory, tuple(chosen))
        timed.append((index, plan))
        heapq.heappush(fastest, plan.tokens_per_s)
        if len(fastest) > top:
            heapq.heappop(fastest)
    timed.sort(key=lambda pair: (-pair[1].tokens_per_s, pair[0]))
    return [plan for _, plan in timed[:top]]
