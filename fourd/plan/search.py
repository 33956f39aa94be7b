"""Plans and the search: one configuration evaluated (memory, time, MFU), and every valid configuration for
N GPUs ranked by tokens/s among those that fit."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from fourd.errors import FourdError
from fourd.layout import RECOMPUTE, ZERO_STAGES, Layout, Parallelism, split_ok, tp_ok
from fourd.layout import check as layout_check
from fourd.plan.cluster import group_level, placement
from fourd.plan.job import Job, stage_layers
from fourd.plan.memory import GB, Memory, peak_memory
from fourd.plan.perf import StepTime, step_time
from fourd.schedules import SCHEDULES

MICRO_SEQS = (1, 2, 4, 8, 16)  # sequences per microbatch the search tries
MIN_CP_TOKENS = 1024  # the search splits a sequence over CP ranks only down to this many tokens each


@dataclass(frozen=True)
class Fixed:
    """The settings a user pinned; None leaves one to the planner (fastest that fits)."""

    layout: Layout | None = None
    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    zero: int | None = None
    recompute: str | None = None
    sequence_parallel: bool = True
    hsdp_replicas: int = 1


@dataclass(frozen=True)
class Plan:
    job: Job
    step: StepTime
    memory: Memory
    chosen: tuple[str, ...] = field(default=())  # settings the planner chose because the user left them open

    @property
    def config(self) -> Parallelism:
        return self.job.par

    @property
    def model(self):
        return self.job.model

    @property
    def cluster(self):
        return self.job.cluster

    @property
    def seq(self) -> int:
        return self.job.seq

    @property
    def global_seqs(self) -> int:
        return self.job.global_seqs

    @property
    def gpus(self) -> int:
        return self.job.layout.world

    @property
    def micro_seqs(self) -> int:
        return self.job.micro_seqs

    @property
    def fits(self) -> bool:
        return self.memory.fits(self.cluster.gpu.memory_gb * GB)

    @property
    def tokens_per_s(self) -> float:
        return self.global_seqs * self.seq / self.step.step_s

    @cached_property
    def model_flops(self) -> float:
        """FLOPs of one step, 6N + 12·L·H·Q·T per token (PaLM appendix B)."""
        return self.global_seqs * self.seq * self.model.flops_per_token(self.seq)

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step.step_s / self.gpus / 1e12

    @property
    def hw_tflops_per_gpu(self) -> float:
        """Model FLOPs plus recomputation: full recomputation repeats the forward, a third of the total."""
        extra = 1 / 3 if self.config.recompute == "full" else 0.0
        return self.tflops_per_gpu * (1 + extra)

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / self.cluster.gpu.peak_tflops

    @property
    def bubble_fraction(self) -> float:
        return self.step.bubble_s / self.step.step_s

    def placement_levels(self) -> dict[str, str]:
        return {d: group_level(g, self.cluster) for d, g in placement(self.config.layout).items()}

    def to_json(self, train_tokens: float | None = None) -> dict:
        c, s, lay = self.config, self.step, self.config.layout
        out = {
            "model": self.model.to_dict(),
            "cluster": self.cluster.name,
            "gpus": self.gpus,
            "dtype": self.job.precision or self.cluster.dtype,
            "compiled": self.job.compiled,
            "attention": self.job.attention,
            "layout": {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp},
            "schedule": c.schedule,
            "microbatches": c.microbatches,
            "virtual_stages": c.virtual_stages,
            "micro_batch_seqs": self.micro_seqs,
            "zero": c.zero,
            "recompute": c.recompute,
            "sequence_parallel": c.sequence_parallel,
            "seq": self.seq,
            "global_batch_tokens": self.global_seqs * self.seq,
            "memory_gb": {k: round(v, 3) for k, v in self.memory.gb().items()},
            "memory_capacity_gb": self.cluster.gpu.memory_gb,
            "fits": self.fits,
            "step_time_s": s.step_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "breakdown_s": {
                "compute": s.compute_s,
                "tp_comm": s.tp_comm_s,
                "cp_comm": s.cp_comm_s,
                "bubble": s.bubble_s,
                "pp_p2p": s.p2p_s,
                "dp_exposed": s.dp_exposed_s,
                "dp_total": s.dp_total_s,
                "overlap_slowdown": s.overlap_s,
                "optimizer": s.optimizer_s,
            },  # fmt: skip
            "placement": self.placement_levels(),
            "stage_layers": stage_layers(self.model.layers, lay.pp, c.virtual_stages),
            "chosen_by_planner": list(self.chosen),
        }
        if train_tokens:
            out["train_tokens"] = train_tokens
            out["training_days"] = train_tokens / self.tokens_per_s / 86400
        return out


def evaluate(job: Job, chosen=()) -> Plan:
    """The plan of one configuration (valid by fourd.layout.check)."""
    return Plan(job, step_time(job), peak_memory(job)[1], tuple(chosen))


# ---- the search ---------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model, gpus: int, seq: int, global_seqs: int) -> list[Layout]:
    """Every (tp, cp, pp, dp) with tp·cp·pp·dp = gpus that splits the model, the sequence and the batch."""
    out = []
    for tp in _divisors(gpus):
        if not tp_ok(model, tp):
            continue
        for cp in _divisors(gpus // tp):
            if seq % (2 * cp) or (cp > 1 and seq // cp < MIN_CP_TOKENS):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if split_ok(model.layers, pp) and global_seqs % dp == 0:
                    out.append(Layout(tp, cp, pp, dp))
    return out


def _virtual_stages(layers: int, pp: int) -> list[int]:
    """V values that split the layers cleanly: every stage the same, or first and last one fewer."""
    return [
        v
        for v in range(2, (layers + 2) // pp + 1)
        if split_ok(layers, pp * v) and (layers % (pp * v) == 0 or (layers + 2) % (pp * v) == 0)
    ]


def configs(model, gpus: int, seq: int, global_seqs: int, fixed: Fixed):
    """Every Parallelism the fixed settings allow, recomputation "none" (see `search`)."""
    sp = fixed.sequence_parallel
    for lay in [fixed.layout] if fixed.layout else layouts(model, gpus, seq, global_seqs):
        if sp and (seq // lay.cp) % lay.tp:
            continue
        per_replica = global_seqs // lay.dp
        if fixed.microbatches:
            counts = [fixed.microbatches] if per_replica % fixed.microbatches == 0 else []
        else:
            counts = [per_replica // s for s in MICRO_SEQS if per_replica % s == 0]
        for sched in [fixed.schedule] if fixed.schedule else SCHEDULES:
            if lay.pp == 1 and fixed.schedule is None and sched != "1f1b":
                continue  # without a pipeline every schedule is the same
            if sched == "interleaved" and lay.pp > 1:
                vs = [fixed.virtual_stages] if fixed.virtual_stages else _virtual_stages(model.layers, lay.pp)
            else:
                vs = [fixed.virtual_stages or 1] if lay.pp == 1 else [1]
            for v in vs:
                for m in counts:
                    for z in [fixed.zero] if fixed.zero is not None else ZERO_STAGES:
                        yield Parallelism(lay, sched, m, v, z, "none", sp, fixed.hsdp_replicas)


def valid(job: Job) -> bool:
    """Whether fourd.layout.check lets the job run (the search skips what pinned settings rule out)."""
    try:
        layout_check(job.model, job.par, job.seq, job.global_seqs)
    except FourdError:
        return False
    return True


def search(base: Job, gpus: int, fixed: Fixed, chosen=()) -> list[Plan]:
    """Plans for every configuration of `gpus` GPUs for `base`'s model, cluster, sequence and batch (its own
    Parallelism is ignored), fitting ones first, fastest first. Recomputation, when left open, is the
    lightest that fits (none, then selective, then full): each costs time and saves memory."""
    plans = []
    capacity = base.cluster.gpu.memory_gb * GB
    for par in configs(base.model, gpus, base.seq, base.global_seqs, fixed):
        job = replace(base, par=par)
        if not valid(job):
            continue
        for rc in [fixed.recompute] if fixed.recompute else RECOMPUTE:
            job = job.with_par(recompute=rc)
            memory = peak_memory(job)[1]
            if memory.fits(capacity):
                break
        plans.append(Plan(job, step_time(job), memory, tuple(chosen)))
    plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s if p.fits else p.memory.total))
    return plans
