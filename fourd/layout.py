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
        for d in DIMS:
            v = getattr(self, d)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise FourdError(
                    f"layout {d}={v!r}: each degree must be a positive integer, e.g. {d}=2"
                )

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coords(self, rank: int) -> dict[str, int]:
        """{tp, cp, pp, dp} indices of a rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1} of layout {self}")
        out = {}
        for d in DIMS:
            rank, out[d] = divmod(rank, getattr(self, d))
        return out

    def rank(self, tp: int = 0, cp: int = 0, pp: int = 0, dp: int = 0) -> int:
        idx = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
        r = 0
        for d in reversed(DIMS):
            if not 0 <= idx[d] < getattr(self, d):
                raise ValueError(
                    f"{d} index {idx[d]} outside 0..{getattr(self, d) - 1} of layout {self}"
                )
            r = r * getattr(self, d) + idx[d]
        return r

    def __str__(self) -> str:
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS)


def parse_layout(text: str) -> Layout:
    """`tp=2,cp=1,pp=2,dp=2`; omitted dimensions are 1, so `dp=1` is one rank."""
    values: dict[str, int] = {}
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        key, sep, val = (s.strip() for s in part.partition("="))
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
ZERO_STAGES = (
    0,
    1,
    2,
    3,
)  # 0 replicates (DDP); 1 shards optimizer state; 2 and gradients; 3 and weights
# What a layer keeps for backward, lightest recomputation first (fourd.plan.block says what each
# keeps): selective recomputes cheap ops, per-op also every other matmul (torchtitan's policy), full
# the whole layer.
RECOMPUTE = ("none", "selective", "per-op", "full")


@dataclass(frozen=True)
class Parallelism:
    """How a run is cut: the layout and the settings that go with it, as plan and train both name
    them."""

    layout: Layout
    schedule: str = "1f1b"
    microbatches: int = 1  # per data-parallel replica per step
    virtual_stages: int = (
        1  # pipeline stages per rank; more than one only with the interleaved schedule
    )
    zero: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    hsdp_replicas: int = (
        1  # more than one: ZeRO-3 inside each replica group, gradients all-reduced across
    )

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
    return all(v % tp == 0 for v in (model.heads, model.kv_heads, model.ffn, model.vocab))


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
        ok = [t for t in range(1, model.kv_heads + 1) if tp_ok(model, t)]
        raise FourdError(
            f"tp={lay.tp} cannot cut the model's heads ({model.heads}), KV heads "
            f"({model.kv_heads}), FFN width ({model.ffn}) and vocabulary ({model.vocab}) into "
            f"equal parts: choose tp among {', '.join(map(str, ok))}"
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
        or (par.hsdp_replicas > 1 and par.zero != 3)
    ):
        raise FourdError(
            f"HSDP replicas = {par.hsdp_replicas} with ZeRO stage {par.zero}: HSDP is ZeRO 3 "
            f"inside each replica group, and the replicas must divide dp={lay.dp}: choose among "
            f"{', '.join(str(d) for d in range(1, lay.dp + 1) if lay.dp % d == 0)} with ZeRO stage "
            "3"
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
        for s in [0, stages - 1, *range(1, stages - 1)][:extra]:
            counts[s] += 1
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
    for s in [*range(1, stages - 1), 0, stages - 1][:extra]:
        counts[s] += 1
    return counts
