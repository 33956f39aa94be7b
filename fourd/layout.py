"""The 4D layout and the words plan and train share for how a run is cut, with their one validator
(pure Python).

Ranks are numbered innermost first in the order [TP, CP, PP, DP] of the Llama 3 paper (§3.3.2):
rank = tp + TP·(cp + CP·(pp + PP·dp)); TP's per-layer all-reduces stay inside a server
(docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from fourd.errors import FourdError, plural
from fourd.schedules import SCHEDULES, check_stages

# Innermost first: the order of the rank formula and of the layout string.
DIMS = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        for dim in DIMS:
            degree = getattr(self, dim)
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise FourdError(
                    f"layout {dim}={degree!r}: each degree must be a positive integer, e.g. {dim}=2"
                )

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coords(self, rank: int) -> dict[str, int]:
        """{tp, cp, pp, dp} indices of a rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1} of layout {self}")
        out = {}
        for dim in DIMS:
            rank, out[dim] = divmod(rank, getattr(self, dim))
        return out

    def rank(self, tp: int = 0, cp: int = 0, pp: int = 0, dp: int = 0) -> int:
        idx = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        rank_index = 0
        for dim in reversed(DIMS):
            if not 0 <= idx[dim] < getattr(self, dim):
                raise ValueError(
                    f"{dim} index {idx[dim]} outside 0..{getattr(self, dim) - 1} of layout {self}"
                )
            rank_index = rank_index * getattr(self, dim) + idx[dim]
        return rank_index

    def __str__(self) -> str:
        return ",".join(f"{dim}={getattr(self, dim)}" for dim in DIMS)


def parse_layout(text: str) -> Layout:
    """`tp=2,cp=1,pp=2,dp=2`; omitted dimensions are 1, so `dp=1` is one rank."""
    values: dict[str, int] = {}
    for part in (item.strip() for item in str(text).split(",")):
        if not part:
            continue
        key, sep, val = (word.strip() for word in part.partition("="))
        if not sep or key not in DIMS:
            raise FourdError(
                f"layout {text!r}: bad item {part!r}; write key=value with keys {', '.join(DIMS)}"
            )
        if key in values:
            raise FourdError(f"layout {text!r}: {key} is given twice; give each dimension once")
        try:
            values[key] = int(val)
        except ValueError:
            raise FourdError(
                f"layout {text!r}: {key}={val!r} must be a positive integer, e.g. {key}=2"
            ) from None
    return Layout(**values)


# Schedule names are fourd.schedules'.
PRECISIONS = ("bf16", "fp32")  # BF16 autocast over FP32 master weights, or plain FP32
# 0 replicates (DDP); 1 shards optimizer state; 2 and gradients; 3 and weights (Rajbhandari et
# al. 2020, ZeRO, §5)
ZERO_STAGES = (0, 1, 2, 3)
# What a layer keeps for backward, lightest recomputation first (fourd.plan.block says what each
# keeps): none recomputes nothing, selective recomputes the cheap ops, per-op also every other
# matmul (torchtitan's policy), full the whole layer.
RECOMPUTE = ("none", "selective", "per-op", "full")


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """How a run is cut: the layout and the settings that go with it, as plan and train both name
    them."""

    layout: Layout
    schedule: str = "1f1b"  # one of fourd.schedules.SCHEDULES
    microbatches: int = 1  # per data-parallel replica per step
    # pipeline stages per rank; more than one only with the interleaved schedule
    virtual_stages: int = 1
    zero: int = 1  # one of ZERO_STAGES
    recompute: str = "none"  # one of RECOMPUTE
    sequence_parallel: bool = False
    # more than one: ZeRO 1-3 inside each replica group, gradients all-reduced across (fourd train
    # runs it with ZeRO 3: FSDP2's HSDP)
    hsdp_replicas: int = 1

    @property
    def stages(self) -> int:
        """Pipeline stages of the whole model (pp × virtual stages)."""
        return self.layout.pp * self.virtual_stages

    @property
    def grad_ranks(self) -> int:
        """Ranks that average gradients: the DP replicas and the CP ranks (different tokens, same
        weights)."""
        return self.layout.dp * self.layout.cp

    @property
    def hsdp(self) -> bool:
        return self.hsdp_replicas > 1

    @property
    def shard_ranks(self) -> int:
        """Ranks one ZeRO shard group spans: FSDP over dp×cp, divided among the HSDP replicas."""
        return self.grad_ranks // self.hsdp_replicas


def tp_ok(model, tp: int) -> bool:
    """Each TP rank holds whole heads and whole KV heads, and equal blocks of the FFN and the
    vocabulary."""
    return all(count % tp == 0 for count in (model.heads, model.kv_heads, model.ffn, model.vocab))


def split_ok(layers: int, stages: int) -> bool:
    """Every pipeline stage gets a layer, except that with exactly layers + 2 stages the first and
    last hold only the embedding and the output (layer_split)."""
    return stages <= layers or stages == layers + 2


def _choose(name: str, value, allowed) -> None:
    if value not in allowed or isinstance(value, bool):
        raise FourdError(f"{name} {value!r}: choose one of {', '.join(map(str, allowed))}")


def check(model, par: Parallelism, seq: int, global_seqs: int) -> None:
    """FourdError naming the fix for a run that cannot go: the one validator of plan, sim, lab and
    train (model: a fourd.model.config.ModelConfig; global_seqs: sequences per step)."""
    lay = par.layout
    _choose("schedule", par.schedule, SCHEDULES)
    _choose("ZeRO stage", par.zero, ZERO_STAGES)
    _choose("recomputation", par.recompute, RECOMPUTE)
    if not tp_ok(model, lay.tp):
        choices = [degree for degree in range(1, model.kv_heads + 1) if tp_ok(model, degree)]
        raise FourdError(
            f"tp={lay.tp} cannot cut the model's heads ({model.heads}), KV heads "
            f"({model.kv_heads}), FFN width ({model.ffn}) and vocabulary ({model.vocab}) into "
            f"equal parts: choose tp among {', '.join(map(str, choices))}"
        )
    check_stages(par.schedule, lay.pp, par.microbatches, par.virtual_stages)
    if lay.pp == 1 and par.virtual_stages > 1:
        raise FourdError(
            f"{par.virtual_stages} virtual stages need a pipeline: choose pp > 1 or one virtual "
            "stage"
        )
    if not split_ok(model.layers, par.stages):
        raise FourdError(
            f"pp={lay.pp} with {plural(par.virtual_stages, 'virtual stage')} makes {par.stages} "
            f"pipeline stages for {model.layers} layers: use at most {model.layers} stages, or "
            f"exactly {model.layers + 2} (the embedding and the output a stage each)"
        )
    if seq < 2 or seq % (2 * lay.cp):
        raise FourdError(
            f"sequence length {seq} is not a multiple of 2·cp = {2 * lay.cp} (context parallelism "
            f"cuts each sequence into 2·cp chunks): choose a multiple of {2 * lay.cp}, or a "
            "smaller cp"
        )
    if par.sequence_parallel and (seq // lay.cp) % lay.tp:
        raise FourdError(
            f"sequence parallelism cuts each rank's {seq // lay.cp} tokens into tp={lay.tp} parts: "
            f"choose a sequence length that is a multiple of cp·tp = {lay.cp * lay.tp}, or turn "
            "sequence parallelism off"
        )
    if global_seqs < 1 or global_seqs % (lay.dp * par.microbatches):
        raise FourdError(
            f"the global batch of {global_seqs} sequences does not split into dp × microbatches = "
            f"{lay.dp} × {par.microbatches} equal parts: choose a global batch that is a multiple "
            f"of {lay.dp * par.microbatches}"
        )
    if (
        par.hsdp_replicas < 1
        or lay.dp % par.hsdp_replicas
        or (par.hsdp_replicas > 1 and par.zero == 0)
    ):
        divisors = [str(count) for count in range(1, lay.dp + 1) if lay.dp % count == 0]
        raise FourdError(
            f"HSDP replicas = {par.hsdp_replicas} with ZeRO stage {par.zero}: ZeRO shards within "
            f"each replica group, and the replicas must divide dp={lay.dp}: choose among "
            f"{', '.join(divisors)} with ZeRO stage 1, 2 or 3"
        )


def layer_split(
    n_layers: int, stages: int, fewer_first_last: bool = True, empty_edges: bool = False
) -> list[int]:
    """Transformer layers of each pipeline stage, in model order; the trainer's split and the
    planner's. With `fewer_first_last` the first and last stage hold one layer fewer (Llama 3 paper
    §3.3.2: 126 in 16 are 7, 8, ..., 8, 7), unless a stage would be empty: then an even split, or
    with `empty_edges` edge stages holding only the embedding and the output
    (docs/pipeline-context.md)."""
    if stages < 1 or n_layers < 1:
        raise FourdError(f"{n_layers} layers in {stages} pipeline stages: both must be at least 1")
    if stages == 1:
        return [n_layers]
    if fewer_first_last:
        base, extra = divmod(n_layers + 2, stages)
        counts = [base] * stages
        for stage in [0, stages - 1, *range(1, stages - 1)][:extra]:
            counts[stage] += 1
        counts[0] -= 1
        counts[-1] -= 1
        if min(counts[1:-1], default=1) >= 1 and (min(counts) >= 1 or empty_edges):
            return counts
    if n_layers < stages:
        raise FourdError(
            f"{n_layers} layers cannot fill {stages} pipeline stages: lower pp or the virtual "
            "stages"
        )
    base, extra = divmod(n_layers, stages)
    counts = [base] * stages
    for stage in [*range(1, stages - 1), 0, stages - 1][:extra]:
        counts[stage] += 1
    return counts
