"""The 4D layout: how many ways each parallel dimension cuts the work, and which rank sits where.

Pure Python, so that the planner, the simulator and the CLI can read layouts without torch.

Ranks are numbered innermost first in the order [TP, CP, PP, DP], as in Llama 3 (brief.md §1, row 10):
rank = tp + TP·(cp + CP·(pp + PP·dp)). TP is innermost because its all-reduces are on the critical path
of every layer and must stay on the fast links inside a server; DP is outermost because its gradient
reduction happens once per step and overlaps with backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from fourd.errors import FourdError

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
                raise FourdError(f"layout {d}={v!r}: each degree must be a positive integer, e.g. {d}=2")

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
                raise ValueError(f"{d} index {idx[d]} outside 0..{getattr(self, d) - 1} of layout {self}")
            r = r * getattr(self, d) + idx[d]
        return r

    def __str__(self) -> str:
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS)


def parse_layout(text: str) -> Layout:
    """`tp=2,cp=1,pp=2,dp=2` (contract syntax); omitted dimensions are 1, so `dp=1` is one rank."""
    values: dict[str, int] = {}
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        key, sep, val = (s.strip() for s in part.partition("="))
        if not sep or key not in DIMS:
            raise FourdError(f"layout {text!r}: bad item {part!r}; write key=value with keys {', '.join(DIMS)}")
        if key in values:
            raise FourdError(f"layout {text!r}: {key} is given twice; give each dimension once")
        try:
            values[key] = int(val)
        except ValueError:
            raise FourdError(f"layout {text!r}: {key}={val!r} must be a positive integer, e.g. {key}=2") from None
    return Layout(**values)


def validate_layout(
    layout: Layout,
    model_cfg,
    seq: int,
    global_batch: int,
    microbatches: int = 1,
    world: int | None = None,
    virtual_stages: int = 1,
    sequence_parallel: bool = False,
    hsdp_replicate: int | None = None,
) -> None:
    """Refuse, before any worker starts, every layout the trainer cannot run; one line naming the fix.

    model_cfg is a fourd.model.config.ModelConfig; seq the sequence length; global_batch the sequences
    per optimizer step; world the number of processes actually started (None: not known yet);
    hsdp_replicate the number of HSDP replicas when data parallelism is HSDP.
    KV heads are not replicated: TP must divide the KV heads, as Llama 3 does (8 KV heads, TP = 8).
    """
    tp, cp, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
    if world is not None and layout.world != world:
        raise FourdError(
            f"layout {layout} needs {layout.world} ranks (tp·cp·pp·dp) but {world} processes run: "
            f"make the product of the degrees equal {world}"
        )
    # Each TP rank holds whole heads, whole KV heads, and equal column blocks of the FFN and the vocabulary.
    cut = {
        "heads": model_cfg.heads,
        "KV heads": model_cfg.kv_heads,
        "FFN width": model_cfg.ffn,
        "vocabulary": model_cfg.vocab,
    }
    for name, value in cut.items():
        if value % tp:
            choices = [d for d in range(1, model_cfg.kv_heads + 1) if all(v % d == 0 for v in cut.values())]
            raise FourdError(
                f"layout tp={tp}: the model's {name} ({value}) cannot be cut into tp={tp} equal parts: "
                f"choose tp among {', '.join(map(str, choices))}"
            )
    if not (isinstance(virtual_stages, int) and virtual_stages >= 1):
        raise FourdError(f"virtual stages = {virtual_stages!r} must be a positive integer")
    stages = pp * virtual_stages
    if model_cfg.layers < stages:
        raise FourdError(
            f"layout pp={pp} with {virtual_stages} virtual stage(s) makes {stages} pipeline stages but the model "
            f"has {model_cfg.layers} layers: use pp × virtual stages ≤ {model_cfg.layers}"
        )
    if seq % (2 * cp):
        raise FourdError(
            f"sequence length {seq} is not divisible by 2·cp = {2 * cp} (context parallelism cuts each sequence "
            f"into 2·cp chunks): choose a sequence length that is a multiple of {2 * cp}, or a smaller cp"
        )
    if sequence_parallel and (seq // cp) % tp:
        raise FourdError(
            f"sequence parallelism cuts each rank's {seq // cp} tokens into tp={tp} parts: choose a sequence "
            f"length that is a multiple of cp·tp = {cp * tp}, or turn sequence parallelism off"
        )
    if not (isinstance(microbatches, int) and microbatches >= 1):
        raise FourdError(f"microbatches = {microbatches!r} must be a positive integer")
    if global_batch % (dp * microbatches):
        raise FourdError(
            f"global batch {global_batch} sequences is not divisible by dp × microbatches = {dp} × {microbatches}"
            f" = {dp * microbatches}: choose a global batch that is a multiple of {dp * microbatches}"
        )
    bad_hsdp = not (isinstance(hsdp_replicate, int) and hsdp_replicate >= 1 and dp % hsdp_replicate == 0)
    if hsdp_replicate is not None and bad_hsdp:
        raise FourdError(
            f"HSDP replicas = {hsdp_replicate!r} must divide dp={dp} (replicas × shard groups = dp): "
            f"choose one of {', '.join(str(d) for d in range(1, dp + 1) if dp % d == 0)}"
        )


def layer_split(n_layers: int, stages: int, fewer_first_last: bool = True, empty_edges: bool = False) -> list[int]:
    """Transformer layers of each pipeline stage, in model order; the trainer's split and the planner's.

    With `fewer_first_last` the embedding and the output projection count as one layer each, so the
    first and last stage hold one layer fewer than the middle ones (Llama 3 paper §3.3.2: 126 layers in
    16 stages are 7, 8, ..., 8, 7); layers left over go to the first and last stage first, which keeps
    every stage's work equal where it can be (128 in 16: all 8; 32 in 4: all 8). If that would leave a
    stage empty, the layers are split evenly instead (leftovers to the middle stages), unless
    `empty_edges` lets the first and last stage hold only the embedding and the output (the planner's
    405B with 128 stages).
    """
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
        raise FourdError(f"{n_layers} layers cannot fill {stages} pipeline stages: lower pp or the virtual stages")
    base, extra = divmod(n_layers, stages)
    counts = [base] * stages
    for s in [*range(1, stages - 1), 0, stages - 1][:extra]:
        counts[s] += 1
    return counts
