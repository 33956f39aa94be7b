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
    kv_used: int  # K and V as attention reads them: repeated to every query head unless shared
    f: int
    heads: int  # local query heads
    b: int  # activation bytes
    r: int  # residual-stream bytes: FP32 when BF16 autocast runs over FP32 weights
    casts: int  # copies of a linear's input cast to the compute precision, per linear (0 or 1)


def sizes(work: Work) -> Sizes:
    model, tp = work.model, work.layout.tp
    heads, kv_heads = model.heads // tp, max(1, model.kv_heads // tp)
    act_bytes = work.dtype_bytes
    stream_bytes = F32 if work.autocast else act_bytes
    # the stacks that copy each K and V head to its query heads before a flash kernel (torchtitan's
    # repeat_kv); SDPA's enable_gqa (fourd) shares them
    copies_kv = work.attention == "flash" and heads != kv_heads and not work.shared_kv
    return Sizes(
        norm=model.dim / (tp if work.sequence_parallel else 1),
        h=model.dim,
        q=heads * model.head_dim,
        kv=kv_heads * model.head_dim,
        kv_used=(heads if copies_kv else kv_heads) * model.head_dim,
        f=model.ffn // tp,
        heads=heads,
        b=act_bytes,
        r=stream_bytes,
        casts=int(stream_bytes != act_bytes),
    )


def matmuls(work: Work) -> list[tuple[int, int]]:
    """(n, k) of the block's forward matmuls on one rank in program order (m: the tokens): Llama's
    wq, wk, wv, wo, w1, w3, w2; GPT blocks fuse Q, K and V (Megatron)."""
    dims = sizes(work)
    if work.model.mlp == "swiglu":
        return [
            (dims.q, dims.h),
            (dims.kv, dims.h),
            (dims.kv, dims.h),
            (dims.h, dims.q),
            (dims.f, dims.h),
            (dims.f, dims.h),
            (dims.h, dims.f),
        ]
    return [(dims.q + 2 * dims.kv, dims.h), (dims.h, dims.q), (dims.f, dims.h), (dims.h, dims.f)]


@dataclass(frozen=True)
class Traffic:
    forward: float  # HBM bytes of the memory-bound kernels, forward
    backward: (
        float  # and backward (each op's backward reads its output's gradient and saved inputs)
    )
    saved: float  # activation bytes kept for backward with this recomputation
    # memory-bound bytes the recomputation redoes in backward (besides `full`'s whole forward)
    redo: float


def _norm_eager(dims: Sizes) -> float:
    """fourd's RMSNorm: x.float(), pow, mean, ·rsqrt, .type_as(x), ·weight; casts only when x is not
    FP32."""
    cast = 2 * (dims.r + F32) if dims.r < F32 else 0
    return (8 + 4 + 8 + 2 * dims.r + cast) * dims.norm


def _rope_eager(elements: int, act_bytes: int) -> float:
    """apply_rope on n elements: float(), four products and two sums on the halves, stack,
    type_as."""
    return (16 + 12 + 8 + (2 * (act_bytes + F32) if act_bytes < F32 else 0)) * elements


def _eager_llama_bytes(dims: Sizes, repeat: float) -> tuple[float, float, float]:
    """(forward bytes, kept bytes, norm and linear inputs kept) per token of fourd's eager Llama
    block: its RMSNorms, adds and casts, RoPE, SwiGLU, and the GQA copies `repeat`."""
    act_bytes, stream_bytes = dims.b, dims.r
    norms = (
        2 * _norm_eager(dims)
        + 2 * (2 * stream_bytes + act_bytes) * dims.norm
        + 5 * dims.casts * (stream_bytes + act_bytes) * dims.h
    )  # and adds, casts
    # the attention kernel writes its output token-major, so the heads' reshape copies nothing
    attn = _rope_eager(dims.q, act_bytes) + _rope_eager(dims.kv, act_bytes) + repeat
    act = 5 * act_bytes * dims.f  # silu, then the product
    # the norms' FP32 results and each linear's input (with sequence parallelism its shard,
    # gathered again in backward); besides them the norms' FP32 inputs, attention's inputs and
    # output, and the MLP's four tensors. RoPE keeps nothing of its own: its products' other
    # factors are the cos and sin tables, which need no gradient.
    outputs = 2 * F32 * dims.norm + (5 if dims.casts else 2) * act_bytes * dims.norm
    kept = (
        2 * F32 * dims.norm + act_bytes * (2 * dims.q + 2 * dims.kv_used) + 4 * act_bytes * dims.f
    )
    return norms + attn + act, kept, outputs


def _fused_or_gpt_bytes(
    dims: Sizes, repeat: float, swiglu: bool, eager: bool
) -> tuple[float, float, float]:
    """(forward bytes, kept bytes, norm outputs kept) per token of a fused (compiled or the stack's
    kernels) block, or an eager GPT block; `repeat`: the GQA copies."""
    act_bytes, stream_bytes = dims.b, dims.r
    # a fused add-and-norm reads the stream and the branch and writes both; eager GPT blocks run
    # native LayerNorm (one kernel) and the adds apart
    if eager:
        norm_bytes = 2 * (stream_bytes + act_bytes) + 2 * (2 * stream_bytes + act_bytes)
    else:
        norm_bytes = 4 * (stream_bytes + act_bytes)
    norms = norm_bytes * dims.norm
    attn = repeat  # GPT blocks add their biases inside the GEMMs
    if swiglu:
        attn = 2 * act_bytes * (dims.q + dims.kv) + repeat  # RoPE
    act = (3 if swiglu else 2) * act_bytes * dims.f
    outputs = 2 * act_bytes * dims.norm
    kept = (
        2 * stream_bytes * dims.norm
        + act_bytes * (2 * dims.q + 2 * dims.kv_used)
        + (3 if swiglu else 2) * act_bytes * dims.f
    )
    return norms + attn + act, kept, outputs


def _recomputed(work: Work, dims: Sizes, forward: float, kept: float) -> Traffic:
    """The layer's traffic under the job's recomputation, from its `forward` bytes and the bytes
    `kept` without recomputation (docs/planner.md's recomputation row says what each keeps)."""
    act_bytes, stream_bytes = dims.b, dims.r
    backward = BACKWARD[work.model.mlp == "swiglu" and not work.fused] * forward
    if work.recompute == "full":
        return Traffic(forward, backward, stream_bytes * dims.norm, 0.0)
    if work.recompute == "per-op":
        inputs = matmuls(work)[::2]
        # row-parallel outputs: SP shards
        saved = sum(dims.norm if width == dims.h else width for width, _ in inputs) + dims.q
        kept_per_op = stream_bytes * dims.norm + act_bytes * saved + F32 * dims.heads
        return Traffic(forward, backward, kept_per_op, forward)
    if work.recompute == "selective" and not work.recomputes_attention:  # beside a fused kernel
        # fourd's policy (fourd.parallel.recompute): wo and w2 feed the residual stream, backward
        # needs neither of their outputs
        unsaved = (3, 6) if work.model.mlp == "swiglu" else (1, 3)
        saved_outputs = (width for i, (width, _) in enumerate(matmuls(work)) if i not in unsaved)
        saved = sum(saved_outputs) + dims.q  # and attention's output
        kept_selective = 2 * stream_bytes * dims.norm + act_bytes * saved + F32 * dims.heads
        return Traffic(forward, backward, kept_selective, forward)
    if work.attention != "flash" and work.recompute == "none":
        kept += score_bytes(work).kept * dims.heads * work.seq
    return Traffic(forward, backward, kept, 0.0)


@lru_cache(maxsize=4096)
def traffic(work: Work) -> Traffic:
    """Memory-bound bytes and kept activations of one layer, per token, on one rank, under the job's
    recomputation (docs/planner.md's recomputation row says what each keeps)."""
    dims = sizes(work)
    swiglu = work.model.mlp == "swiglu"
    eager = not work.fused
    repeat = 0  # GQA: K and V copied to every query head
    if dims.kv_used != dims.kv:
        repeat = 2 * dims.b * (dims.kv + dims.kv_used)
    if swiglu and eager:
        forward, kept, outputs = _eager_llama_bytes(dims, repeat)
    else:
        forward, kept, outputs = _fused_or_gpt_bytes(dims, repeat, swiglu, eager)
    kept += outputs + F32 * dims.heads  # and attention's logsumexp
    counted = _recomputed(work, dims, forward, kept)
    if work.fp8:
        cast_forward, cast_backward = fp8_bytes(work)
        counted = Traffic(
            counted.forward + cast_forward,
            counted.backward + cast_backward,
            counted.saved - fp8_kept_savings(work),
            counted.redo + (cast_forward if counted.redo else 0.0),
        )
    if not (eager and work.model.mlp == "gelu_new"):
        return counted
    more = gelu_new_bytes(dims)
    kept_more = more.kept if work.recompute == "none" else 0.0  # else recomputed, not kept
    return Traffic(
        counted.forward + more.forward * dims.f,
        counted.backward + more.backward * dims.f,
        counted.saved + kept_more * dims.f,
        counted.redo + (more.forward * dims.f if counted.redo else 0.0),
    )


def fp8_bytes(work: Work) -> tuple[float, float]:
    """(forward, backward) bytes per token on one rank of the passes FP8 training adds to a layer, as
    Transformer Engine runs its linear layers (Hopper's FP8 GEMMs read both operands K-major, so each
    operand a GEMM needs transposed is written a second time, transposed):

    - forward, the attention output (q elements, BF16 from the attention kernel) cast to FP8 with
      its transpose for the weight gradient, one kernel: read 2 B, write 1 + 1 B, 4 B an element.
      The norms before QKV and the MLP, and the MLP's activation, write their FP8 output themselves
      (LayerNormLinear, LayerNormMLP): no pass of their own;
    - backward, the FP8 inputs the forward kept transposed for the weight gradients (read 1 B,
      write 1 B): the QKV's and the MLP's input, h elements each (gathered whole under SP), and
      w2's, f (the FFN width on the rank); and every linear layer's output gradient cast to FP8
      (E5M2) with its transpose, 4 B an element: QKV's q + 2·kv, the attention projection's and
      w2's h each (their gathered output), w1's f and a gated MLP's w3's f.

    The weights' casts, once a step, and the scaling factors' bookkeeping are left out (bytes per
    parameter a step, not per token)."""
    dims = sizes(work)
    gated = work.model.mlp == "swiglu"
    forward = 4 * dims.q
    transposes = 2 * (2 * dims.h + dims.f)
    gradients = 4 * ((dims.q + 2 * dims.kv) + 2 * dims.h + (2 if gated else 1) * dims.f)
    return forward, transposes + gradients


def fp8_kept_savings(work: Work) -> float:
    """Bytes per token on one rank that FP8 training keeps for the backward below BF16's: the linear
    layers keep their inputs for the weight gradients as FP8 (1 B an element, Transformer Engine's
    modules and torchao's Float8Linear alike) where BF16 keeps them at the activation's bytes. The
    inputs kept: without recomputation, and with a selective policy that recomputes the attention core
    alone, the two norms' outputs (SP shards), attention's output and w2's input; with fourd's
    selective policy attention's output alone (the norms and the activation are recomputed); with
    full or per-op recomputation none is counted."""
    dims = sizes(work)
    if work.recompute == "none" or (work.attention == "flash" and work.recomputes_attention):
        elements = 2 * dims.norm + dims.q + dims.f
    elif work.recompute == "selective" and work.attention == "flash":
        elements = dims.q
    else:
        elements = 0.0
    return elements * (dims.b - 1)


@dataclass(frozen=True)
class GeluNewBytes:
    """Bytes per FFN element that Hugging Face's eager NewGELUActivation moves and keeps beyond
    one GeLU kernel's."""

    forward: float
    backward: float
    kept: float


def gelu_new_bytes(dims: Sizes) -> GeluNewBytes:
    """What eager `gelu_new` (Hugging Face's NewGELUActivation, GPT-2's activation: the tanh
    approximation 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) of Hendrycks & Gimpel 2016, each
    operation a kernel) moves and keeps per FFN element beyond one GeLU kernel (2b forward, 3b
    backward, b kept). With b the activations' bytes and s those of the pow chain (FP32 under
    autocast, which runs pow in FP32: its input cast by a kernel of its own, and the FP32 result
    cast back for the next linear; b without):

    forward: 0.5·x 2b, pow 2s, ·0.044715 2s, x + · b + 2s, ·√(2/π) 2s, tanh 2s, 1 + · 2s,
    the product b + 2s = 4b + 14s, and under autocast the two casts 2(b + s);
    backward: the product's two gradients (b + 2s, 3s), tanh's 3s, the two scalar products 2s each,
    pow's x² (2s), ·3 (2s) and its product (3s), 0.5·x's 2b and the two sums of x's gradient 3b
    each = 9b + 19s, and under autocast four casts (the linear's input's, the two gradients
    cast back to b, the input cast's) 4(b + s);
    kept: pow's input, tanh's output, 0.5·x and 1 + tanh: 3s + b.
    Measured equal by a dispatch mode op by op (tests/test_contract_block.py)."""
    b, s = dims.b, dims.r
    forward = 4 * b + 14 * s
    backward = 9 * b + 19 * s
    # under autocast two casts forward and four backward, each reading one precision, writing the other
    if dims.casts:
        forward += 2 * (b + s)
        backward += 4 * (b + s)
    kept = 3 * s + b
    one_kernel = GeluNewBytes(forward=2 * b, backward=3 * b, kept=b)
    return GeluNewBytes(
        forward=forward - one_kernel.forward,
        backward=backward - one_kernel.backward,
        kept=kept - one_kernel.kept,
    )


@dataclass(frozen=True)
class ScoreBytes:
    """Bytes per attention score (one query-key pair of one head) of materialized attention."""

    forward: float  # memory-bound kernels between the two batched GEMMs, forward
    backward: float
    kept: float  # kept for backward


def score_bytes(work: Work) -> ScoreBytes:
    """Memory-bound bytes per score of attention that writes the s × s scores.

    "materialized" (Megatron's FusedScaleMaskSoftmax, then dropout; Korthikanti et al. 2022 §4): the
    fused scale-mask-softmax reads and writes b each way, the dropout reads b and writes b and a
    1-byte mask; backward the dropout's 2b + 1, the softmax's 3b; kept: the softmax's output, the mask
    and the dropout's output, 2b + 1.

    "eager" (each op its own kernel, as Hugging Face's GPT2Attention._attn in transformers 4.x: the
    scores divided by √d, torch.where against the causal buffer, softmax, .type back to the values'
    dtype, dropout): with s the softmax's bytes (FP32 under autocast, which casts the softmax's input
    to FP32 by a kernel of its own and computes it in FP32; b without autocast), forward
    2b (scale) + 2b (mask) + [b + s (autocast's cast)] + 2s (softmax) + [s + b (cast back)]
    + 2b + 1 (dropout); backward 2b + 1 (dropout) + [b + s] + 3s (softmax) + [s + b] + 2b (mask)
    + 2b (scale), the bracketed casts under autocast only; the causal buffer, one s × s tensor
    broadcast over the batch and heads, stays in cache. Kept: the softmax's output, the dropout's
    mask and output, s + 1 + b."""
    b = work.dtype_bytes  # a score's bytes as the GEMMs write it
    if work.attention == "materialized":
        return ScoreBytes(forward=4 * b + 1, backward=5 * b + 1, kept=2 * b + 1)
    softmax_bytes = F32 if work.autocast else b
    casts = 2 * (b + softmax_bytes) if work.autocast else 0
    return ScoreBytes(
        forward=(2 * b) + (2 * b) + 2 * softmax_bytes + (2 * b + 1) + casts,
        backward=(2 * b + 1) + 3 * softmax_bytes + (2 * b) + (2 * b) + casts,
        kept=softmax_bytes + 1 + b,
    )


def loss_bytes(b: int) -> tuple[float, float, float]:
    """(forward, backward, peak held) bytes per logit of torch's cross-entropy on `b`-byte logits
    (cast to FP32, log-softmax, its backward, the cast back; held: the log-probabilities, their
    gradient, its cast)."""
    cast = b + F32 if b < F32 else 0
    return 12 + cast, 4 + 12 + cast, F32 + F32 + b
