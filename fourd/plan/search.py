"""Plans and the search: one configuration evaluated (memory, time, MFU), and every valid configuration for
N GPUs ranked by tokens/s among those that fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from fourd.layout import RECOMPUTE, ZERO_STAGES, Layout, Parallelism, split_ok, tp_ok
from fourd.layout import check as layout_check
from fourd.model.config import ModelConfig
from fourd.plan.cluster import Cluster, check_fits, group_level, placement
from fourd.plan.memory import GB, Memory, fullest_rank, peak_memory, stage_layers
from fourd.plan.perf import StepTime, step_time
from fourd.schedules import SCHEDULES

MICRO_SEQS = (1, 2, 4, 8, 16)  # sequences per microbatch the search tries
MIN_CP_TOKENS = 1024  # the search splits a sequence over CP ranks only down to this many tokens each


@dataclass(frozen=True)
class Config:
    layout: Layout
    schedule: str
    microbatches: int
    virtual_stages: int = 1
    zero: int = 1
    recompute: str = "none"
    sequence_parallel: bool = True


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    cluster: Cluster
    config: Config
    seq: int
    global_seqs: int
    step: StepTime
    memory: Memory
    chosen: tuple[str, ...] = field(default=())  # settings the planner chose because the user left them open

    @property
    def gpus(self) -> int:
        return self.config.layout.world

    @property
    def micro_seqs(self) -> int:
        return self.global_seqs // (self.config.layout.dp * self.config.microbatches)

    @property
    def fits(self) -> bool:
        return self.memory.total + self.memory.reserve <= self.cluster.gpu.memory_gb * GB

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
        return {d: group_level(g, self.cluster) for d, g in placement(self.config.layout, self.cluster).items()}

    def to_json(self, train_tokens: float | None = None) -> dict:
        c, s, lay = self.config, self.step, self.config.layout
        out = {
            "model": self.model.to_dict(),
            "cluster": self.cluster.name,
            "gpus": self.gpus,
            "dtype": self.cluster.dtype,
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
            },
            "placement": self.placement_levels(),
            "stage_layers": stage_layers(self.model.layers, lay.pp, c.virtual_stages),
            "chosen_by_planner": list(self.chosen),
        }
        if train_tokens:
            out["train_tokens"] = train_tokens
            out["training_days"] = train_tokens / self.tokens_per_s / 86400
        return out


# ---- validity ----------------------------------------------------------------------------------------------


def check(model, cluster: Cluster, config: Config, seq: int, global_seqs: int) -> None:
    """FourdError naming the fix for a configuration that cannot run (fourd.layout.check, the trainer's too)."""
    check_fits(config.layout.world, cluster)
    c = config
    layout_check(
        model,
        Parallelism(c.layout, c.schedule, c.microbatches, c.virtual_stages, c.zero, c.recompute, c.sequence_parallel),
        seq,
        global_seqs,
    )


def evaluate(model, cluster: Cluster, config: Config, seq: int, global_seqs: int, chosen=()) -> Plan:
    c = config
    step = step_time(
        model,
        cluster,
        c.layout,
        seq,
        global_seqs,
        c.schedule,
        c.microbatches,
        c.virtual_stages,
        c.zero,
        c.recompute,
        c.sequence_parallel,
    )
    return Plan(
        model, cluster, c, seq, global_seqs, step, config_memory(model, cluster, c, seq, global_seqs), tuple(chosen)
    )


def config_memory(model, cluster: Cluster, c: Config, seq: int, global_seqs: int) -> Memory:
    micro = global_seqs // (c.layout.dp * c.microbatches)
    return peak_memory(
        model,
        cluster,
        c.layout,
        seq,
        micro,
        c.schedule,
        c.microbatches,
        c.virtual_stages,
        c.zero,
        c.recompute,
        c.sequence_parallel,
    )


# ---- the search ---------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model, cluster: Cluster, gpus: int, seq: int, global_seqs: int) -> list[Layout]:
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


def configs(
    model,
    cluster: Cluster,
    gpus: int,
    seq: int,
    global_seqs: int,
    layout: Layout | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    zero: int | None = None,
    sequence_parallel: bool = True,
):
    """Every configuration the fixed settings allow, recomputation left open (see `search`)."""
    for lay in [layout] if layout else layouts(model, cluster, gpus, seq, global_seqs):
        if sequence_parallel and (seq // lay.cp) % lay.tp:
            continue
        per_replica = global_seqs // lay.dp
        if microbatches:
            counts = [microbatches] if per_replica % microbatches == 0 else []
        else:
            counts = [per_replica // s for s in MICRO_SEQS if per_replica % s == 0]
        for sched in [schedule] if schedule else SCHEDULES:
            if lay.pp == 1 and schedule is None and sched != "1f1b":
                continue  # without a pipeline every schedule is the same
            if sched == "interleaved" and lay.pp > 1:
                vs = [virtual_stages] if virtual_stages else _virtual_stages(model.layers, lay.pp)
            else:
                vs = [virtual_stages or 1] if lay.pp == 1 else [1]
            for v in vs:
                for m in counts:
                    if sched == "interleaved" and lay.pp > 1 and m < lay.pp:
                        continue
                    for z in [zero] if zero is not None else ZERO_STAGES:
                        yield Config(lay, sched, m, v, z, "none", sequence_parallel)


def search(
    model, cluster: Cluster, gpus: int, seq: int, global_seqs: int, recompute: str | None = None, chosen=(), **fixed
) -> list[Plan]:
    """Plans for every configuration, fitting ones first, fastest first. Recomputation, when left open,
    is the lightest that fits (none, then selective, then full): each costs time and saves memory."""
    check_fits(gpus, cluster)
    plans = []
    capacity = cluster.gpu.memory_gb * GB
    for c in configs(model, cluster, gpus, seq, global_seqs, **fixed):
        micro = global_seqs // (c.layout.dp * c.microbatches)
        for rc in [recompute] if recompute else RECOMPUTE:
            c = Config(c.layout, c.schedule, c.microbatches, c.virtual_stages, c.zero, rc, c.sequence_parallel)
            need, _ = fullest_rank(
                model,
                cluster,
                c.layout,
                seq,
                micro,
                c.schedule,
                c.microbatches,
                c.virtual_stages,
                c.zero,
                rc,
                c.sequence_parallel,
            )
            if need <= capacity:
                break
        plans.append(evaluate(model, cluster, c, seq, global_seqs, chosen))
    plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s if p.fits else p.memory.total))
    return plans
