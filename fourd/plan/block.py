"""What one transformer block moves through memory and keeps for backward, per token on one rank,
eager (each op of fourd/model/llama.py, or a GPT block's) or fused (compiled); counted op by op
(docs/planner.md). The loss always runs eager (fourd, torchtitan and the IBM runs compile the blocks
only)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fourd.plan.job import Work

F32 = 4
# Backward traffic over forward traffic, from the same op-by-op count (docs/planner.md): fourd's
# eager block (RMSNorm 2.1×, RoPE 1.0×, casts and gradient sums 2.2×, SwiGLU 1.6×) 1.7×; fused and
# GPT blocks 1.5×.
BACKWARD = {True: 1.7, False: 1.5}


@dataclass(frozen=True)
class Sizes:
    """Elements per token on one rank (the norms' stream cut by TP with SP) and bytes per
    element."""

    norm: float
    h: int
    q: int
    kv: int
    kv_used: (
        int  # K and V as attention reads them: repeated to every query head in fourd's GQA code
    )
    f: int
    heads: int  # local query heads
    b: int  # activation bytes
    r: int  # residual-stream bytes: FP32 when BF16 autocast runs over FP32 weights
    casts: int  # copies of a linear's input cast to the compute precision, per linear (0 or 1)


def sizes(work: Work) -> Sizes:
    m, tp = work.model, work.layout.tp
    heads, kv = m.heads // tp, max(1, m.kv_heads // tp)
    b = work.dtype_bytes
    r = F32 if work.autocast else b
    eager_gqa = work.attention == "flash" and heads != kv
    return Sizes(
        m.dim / (tp if work.sequence_parallel else 1),
        m.dim,
        heads * m.head_dim,
        kv * m.head_dim,
        (heads if eager_gqa else kv) * m.head_dim,
        m.ffn // tp,
        heads,
        b,
        r,
        int(r != b),
    )


def matmuls(work: Work) -> list[tuple[int, int]]:
    """(n, k) of the block's forward matmuls on one rank in program order (m: the tokens): Llama's
    wq, wk, wv, wo, w1, w3, w2; GPT blocks fuse Q, K and V (Megatron)."""
    s = sizes(work)
    if work.model.mlp == "swiglu":
        return [
            (s.q, s.h),
            (s.kv, s.h),
            (s.kv, s.h),
            (s.h, s.q),
            (s.f, s.h),
            (s.f, s.h),
            (s.h, s.f),
        ]
    return [(s.q + 2 * s.kv, s.h), (s.h, s.q), (s.f, s.h), (s.h, s.f)]


@dataclass(frozen=True)
class Traffic:
    forward: float  # HBM bytes of the memory-bound kernels, forward
    backward: (
        float  # and backward (each op's backward reads its output's gradient and saved inputs)
    )
    saved: float  # activation bytes kept for backward with this recomputation
    # memory-bound bytes the recomputation redoes in backward (besides `full`'s whole forward)
    redo: float


def _norm_eager(s: Sizes) -> float:
    """fourd's RMSNorm: x.float(), pow, mean, ·rsqrt, .type_as(x), ·weight; casts only when x is not
    FP32."""
    cast = 2 * (s.r + F32) if s.r < F32 else 0
    return (8 + 4 + 8 + 2 * s.r + cast) * s.norm


def _rope_eager(n: int, b: int) -> float:
    """apply_rope on n elements: float(), four products and two sums on the halves, stack,
    type_as."""
    return (16 + 12 + 8 + (2 * (b + F32) if b < F32 else 0)) * n


@lru_cache(maxsize=4096)
def traffic(work: Work) -> Traffic:
    """Memory-bound bytes and kept activations of one layer, per token, on one rank, under the job's
    recomputation (docs/planner.md's recomputation row says what each keeps)."""
    s, swiglu = sizes(work), work.model.mlp == "swiglu"
    b, r, eager = s.b, s.r, not work.compiled
    repeat = 0  # GQA: K and V copied to every query head
    if s.kv_used != s.kv:
        repeat = 2 * b * (s.kv + s.kv_used)
    if swiglu and eager:
        norms = (
            2 * _norm_eager(s) + 2 * (2 * r + b) * s.norm + 5 * s.casts * (r + b) * s.h
        )  # and adds, casts
        attn = (
            _rope_eager(s.q, b) + _rope_eager(s.kv, b) + repeat + 2 * b * s.q
        )  # and the heads' reshape
        act = 5 * b * s.f  # silu, then the product
        # the norms' FP32 results and each linear's input (with sequence parallelism its shard,
        # gathered again in backward); besides them the norms' FP32 inputs, RoPE's FP32 copies,
        # attention's inputs and output and the MLP's tensors
        outputs = 2 * F32 * s.norm + (5 if s.casts else 2) * b * s.norm
        kept = 2 * F32 * s.norm + F32 * (s.q + s.kv) + b * (3 * s.q + 2 * s.kv_used) + 4 * b * s.f
    else:
        # a fused add-and-norm reads the stream and the branch and writes both; eager GPT blocks run
        # native LayerNorm (one kernel) and the adds apart
        norms = (4 * (r + b) if not eager else 2 * (r + b) + 2 * (2 * r + b)) * s.norm
        attn = (
            2 * b * (s.q + s.kv) * swiglu + repeat
        )  # RoPE; GPT blocks add their biases inside the GEMMs
        act = (3 if swiglu else 2) * b * s.f
        outputs = 2 * b * s.norm
        kept = 2 * r * s.norm + b * (2 * s.q + 2 * s.kv_used) + (3 if swiglu else 2) * b * s.f
    kept += outputs + F32 * s.heads  # and attention's logsumexp
    forward = norms + attn + act
    backward = BACKWARD[swiglu and eager] * forward
    if work.recompute == "full":
        return Traffic(forward, backward, r * s.norm, 0.0)
    if work.recompute == "per-op":
        saved = (
            sum(s.norm if n == s.h else n for n, _ in matmuls(work)[::2]) + s.q
        )  # row-parallel outputs: SP shards
        return Traffic(forward, backward, r * s.norm + b * saved + F32 * s.heads, forward)
    if (
        work.recompute == "selective" and work.attention == "flash"
    ):  # fourd's policy (fourd.parallel.recompute)
        out = (
            (3, 6) if swiglu else (1, 3)
        )  # wo and w2 feed the residual stream: backward needs neither
        saved = (
            sum(n for i, (n, _) in enumerate(matmuls(work)) if i not in out) + s.q
        )  # and attention's output
        return Traffic(forward, backward, 2 * r * s.norm + b * saved + F32 * s.heads, forward)
    if work.attention == "materialized" and work.recompute == "none":
        kept += (
            5 * s.heads * work.seq
        )  # softmax output, dropout mask and output (Korthikanti et al. 2022 §4)
    return Traffic(forward, backward, kept, 0.0)


def loss_bytes(b: int) -> tuple[float, float, float]:
    """(forward, backward, peak held) bytes per logit of torch's cross-entropy on `b`-byte logits
    (cast to FP32, log-softmax, its backward, the cast back; held: the log-probabilities, their
    gradient, its cast)."""
    cast = b + F32 if b < F32 else 0
    return 12 + cast, 4 + 12 + cast, F32 + F32 + b
