"""The planner's count of what one eager block moves and keeps equals what fourd's block does.

fourd.plan.block counts, op by op, the bytes the memory-bound kernels of fourd.model.llama's block read
and write, and the bytes autograd keeps for backward. Both are measured here on the block itself, on CPU,
with a dispatch mode that sees every aten op (forward traffic) and saved-tensor hooks that see every
tensor autograd keeps, and compared with the planner's numbers exactly: in FP32, and in BF16 autocast
over FP32 weights (fourd's precision on one GPU: an FP32 residual stream, one BF16 cast per linear), with
grouped-query attention and without. fourd.plan.memory's BF16 copies of the weights that autocast makes
are measured the same way.

Conventions of the count, applied to the measurement: matmuls and the attention kernel are timed as
GEMMs, not counted here; views move nothing; tensors of one number a token (the norms' 1/rms) and the
cos and sin tables (one row a position) are below the per-element count's resolution."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fourd.layout import Layout, Parallelism
from fourd.model.config import ModelConfig, get_preset, with_overrides
from fourd.model.llama import Rope, TransformerBlock
from fourd.plan.block import gelu_new_bytes, loss_bytes, score_bytes, sizes, traffic
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.memory import rank_memories
from fourd.plan.stack import load_stack

# 3 × 37 tokens: no weight's or table's element count is a multiple of 111, so the count's
# token-sized tensors are told apart by size alone
BATCH, SEQ = 3, 37
TOKENS = BATCH * SEQ
GQA = get_preset("debug")  # dim 64, 4 heads sharing 2 K/V heads, FFN 176
MHA = with_overrides(GQA, kv_heads=4)
CLUSTER = load_cluster("dgx-h100")
# the GEMMs and the attention kernel, timed apart from the memory-bound ops
NOT_COUNTED = ("aten.mm", "aten.addmm", "aten.bmm", "aten._scaled_dot_product", "aten._unsafe_view")


def _job(cfg, precision: str, recompute: str = "none") -> Job:
    par = Parallelism(layout=Layout(), recompute=recompute)
    return Job(model=cfg, cluster=CLUSTER, par=par, seq=SEQ, global_seqs=BATCH, precision=precision)


def _token_sized(tensor: torch.Tensor) -> bool:
    """More than one element a token, and a whole number of them."""
    return tensor.numel() % TOKENS == 0 and tensor.numel() // TOKENS > 1


class _MemoryBoundBytes(TorchDispatchMode):
    """Bytes each memory-bound op reads and writes: its distinct token-sized tensors, in and out."""

    def __init__(self, tables: list[torch.Tensor]):
        super().__init__()
        self.tables = {table.untyped_storage().data_ptr() for table in tables}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        is_view = any(ret.alias_info is not None and not ret.alias_info.is_write for ret in returns)
        if is_view or str(func).startswith(NOT_COUNTED):
            return out
        seen = set()
        for tensor in tree_flatten((args, kwargs, out))[0]:
            if not isinstance(tensor, torch.Tensor) or not _token_sized(tensor):
                continue
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
            if tensor.untyped_storage().data_ptr() in self.tables or key in seen:
                continue
            seen.add(key)
            self.bytes += tensor.numel() * tensor.element_size()
        return out


def _block(cfg, autocast: bool):
    """One block of `cfg`, its rope rows for SEQ and an input that needs a gradient."""
    torch.manual_seed(0)
    block = TransformerBlock(cfg)
    cos, sin = Rope(cfg.head_dim, cfg.max_seq, cfg.rope_theta)(SEQ)
    x = torch.randn(BATCH, SEQ, cfg.dim, requires_grad=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    return block, cos, sin, x, amp


def _forward_bytes_per_token(cfg, autocast: bool) -> float:
    block, cos, sin, x, amp = _block(cfg, autocast)
    with amp, _MemoryBoundBytes([cos, sin]) as counted:
        block(x, cos, sin)
    return counted.bytes / TOKENS


def _saved(cfg, autocast: bool) -> tuple[float, float]:
    """(activation bytes a token, weight-copy bytes) autograd keeps after one block's forward: every
    distinct storage a saved tensor holds, the block's input included (the previous block's output)."""
    block, cos, sin, x, amp = _block(cfg, autocast)
    own = {t.untyped_storage().data_ptr() for t in (cos, sin, *block.parameters())}
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in own:
            saved[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    with amp, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x, cos, sin)
    activations = weights = 0.0
    for tensor in saved.values():
        if _token_sized(tensor):
            activations += tensor.untyped_storage().nbytes() / TOKENS
        elif tensor.shape[-1] != 1:  # not a per-token scalar: a BF16 copy of a weight
            weights += tensor.untyped_storage().nbytes()
    return activations, weights


CASES = [
    pytest.param(cfg, precision, id=f"{name}-{precision}")
    for name, cfg in (("gqa", GQA), ("mha", MHA))
    for precision in ("fp32", "bf16")
]


@pytest.mark.parametrize("cfg, precision", CASES)
def test_forward_bytes_equal_the_blocks_memory_bound_ops(cfg, precision):
    work = _job(cfg, precision).work
    assert work.autocast == (precision == "bf16") and not work.fused
    assert _forward_bytes_per_token(cfg, work.autocast) == traffic(work).forward


@pytest.mark.parametrize("cfg, precision", CASES)
def test_kept_bytes_equal_what_autograd_saves(cfg, precision):
    work = _job(cfg, precision).work
    activations, _ = _saved(cfg, work.autocast)
    assert activations == traffic(work).saved


def test_the_debug_blocks_bytes_by_hand():
    """FP32, GQA (4 heads, 2 K/V heads of 16), dim 64, FFN 176, elements a token: each RMSNorm moves
    x² (8 B), the mean's read (4), x · 1/rms (8) and · weight (8); the two residual adds 12 each;
    RoPE on Q (64) and K (32) 36 B an element (the products on halves and the stack); SiLU and the
    product 20 B an element of the FFN. Kept: the two norms' inputs, results and linear inputs,
    Q, K, V and the attention output, its log-sum-exp (4 heads), and the MLP's four tensors."""
    work = _job(GQA, "fp32").work
    norms = 2 * 28 * 64 + 2 * 12 * 64
    rope = 36 * (64 + 32)
    mlp = 20 * 176
    assert traffic(work).forward == norms + rope + mlp == 12_096
    kept = 4 * (3 * 2 * 64 + (64 + 32 + 32 + 64) + 4 * 176) + 4 * 4
    assert traffic(work).saved == kept == 5_136


def test_a_stack_that_copies_kv_heads_keeps_the_copies():
    """torchtitan's repeat_kv copies each K/V head to its query heads: the copy is read and written
    (2 · 2 B · (kv + q) a token), and attention keeps the copies, 2 · 2 B · (q − kv) more."""
    shared = _job(GQA, "bf16").work
    copied = dataclasses.replace(shared, shared_kv=False)
    assert load_stack("fourd").shared_kv and not load_stack("fsdp").shared_kv
    assert traffic(copied).forward - traffic(shared).forward == 2 * 2 * (32 + 64)
    assert traffic(copied).saved - traffic(shared).saved == 2 * 2 * (64 - 32)


def test_autocast_keeps_one_bf16_copy_of_each_weight_matrix():
    """The BF16 copies autograd keeps are the layer's seven matrices, 2 B an element; the planner's
    memory adds them for each layer of the rank, and the output projection's on the last."""
    _, copies = _saved(GQA, autocast=True)
    assert copies == 2 * GQA.layer_matrix_params() == 2 * (64 * (64 + 32 + 32 + 64) + 3 * 64 * 176)
    assert _saved(GQA, autocast=False)[1] == 0
    bf16, fp32 = (rank_memories(_job(GQA, p), [0])[0] for p in ("bf16", "fp32"))
    logits = 10 * TOKENS * GQA.vocab  # torch's loss on BF16 logits holds 10 B a logit
    head = 2 * GQA.vocab * GQA.dim
    assert bf16.other == logits + GQA.layers * copies + head
    assert fp32.other == 12 * TOKENS * GQA.vocab  # FP32 logits: 12 B, no copies


def _tp2_work(model, **changes):
    """One rank of tp=2 with sequence parallelism, BF16 weights (a data-parallel wrapper's), flash."""
    par = Parallelism(layout=Layout(tp=2, dp=2), sequence_parallel=True)
    job = Job(model=model, cluster=CLUSTER, par=par, seq=SEQ, global_seqs=2 * BATCH)
    return dataclasses.replace(job.work, **changes)


def test_a_fused_llama_block_by_hand():
    """Llama 3 8B on one of 2 TP ranks with SP (norm stream 2,048 wide, Q 2,048, K and V 512 each,
    FFN 7,168, 16 heads), BF16, K and V shared: each fused add-and-norm reads the stream and the
    branch and writes both (2 · 4 B an element of the stream, twice), RoPE reads and writes Q and K,
    SwiGLU reads two and writes one. Kept: the stream twice, the two norm outputs, Q, K, V, the
    attention output and its log-sum-exp, w1's and w3's outputs and their product; backward 1.5×."""
    model = get_preset("llama3-8b")
    work = _tp2_work(model, fused=True, shared_kv=True)
    assert not work.autocast and work.dtype_bytes == 2
    forward = 2 * 2 * 4 * 2048 + 2 * 2 * (2048 + 512) + 3 * 2 * 7168
    assert traffic(work).forward == forward
    assert traffic(work).backward == 1.5 * forward
    kept = 2 * 2 * 2048 + 2 * 2 * 2048 + 2 * (2 * 2048 + 2 * 512) + 3 * 2 * 7168 + 4 * 16
    assert traffic(work).saved == kept
    # in FP32 every element is 4 B
    fp32 = dataclasses.replace(work, dtype_bytes=4)
    assert traffic(fp32).forward == 2 * 2 * 8 * 2048 + 2 * 4 * (2048 + 512) + 3 * 4 * 7168
    assert traffic(fp32).saved == 2 * (kept - 4 * 16) + 4 * 16  # the log-sum-exp is FP32 in both
    # copied K and V heads: the copy reads 512 and writes 2,048 elements of each, and is what is kept
    copied = dataclasses.replace(work, shared_kv=False)
    assert traffic(copied).forward == forward + 2 * 2 * (512 + 2048)
    assert traffic(copied).saved == kept + 2 * 2 * (2048 - 512)
    copied_fp32 = dataclasses.replace(fp32, shared_kv=False)
    assert traffic(copied_fp32).forward == traffic(fp32).forward + 2 * 4 * (512 + 2048)


def test_an_eager_gpt_block_by_hand():
    """A GPT block (GeLU, LayerNorm, 8 heads of 64, FFN 2,048 over a 512-wide stream) on one of 2 TP
    ranks with SP, BF16: each native LayerNorm reads the stream and writes its output (2 · 2 B), each
    residual add reads two and writes one (3 · 2 B), GeLU reads and writes (2 · 2 B an element of the
    FFN's 1,024 on this rank); backward 1.5×."""
    gpt = ModelConfig(layers=2, dim=512, ffn=2048, heads=8, kv_heads=8, vocab=256, mlp="gelu")
    work = _tp2_work(gpt)
    forward = (2 * 4 + 2 * 6) * 256 + 2 * 2 * 1024
    assert traffic(work).forward == forward
    assert traffic(work).backward == 1.5 * forward
    assert traffic(dataclasses.replace(work, fused=True)).forward == 2 * 2 * 4 * 256 + 2 * 2 * 1024
    # fourd's selective recomputation keeps the stream twice and each matmul's output but those
    # that feed the stream (the attention's and the MLP's output projections), and the attention's
    # output and log-sum-exp: the fused QKV (256 + 2 · 256 on this rank), the first MLP matrix's
    # 1,024, the attention output's 256
    selective = dataclasses.replace(work, recompute="selective")
    assert traffic(selective).saved == 2 * 2 * 256 + 2 * ((256 + 2 * 256) + 1024 + 256) + 4 * 4
    # in FP32 every kept element is 4 B
    selective_fp32 = dataclasses.replace(selective, dtype_bytes=4)
    assert traffic(selective_fp32).saved == 2 * 4 * 256 + 4 * ((256 + 2 * 256) + 1024 + 256) + 4 * 4


def test_materialized_attention_keeps_its_scores_only_without_recomputation():
    """Korthikanti et al. 2022 §4: the s × s scores' softmax output, dropout mask and output, 5 B per
    head per key a token (2 + 1 + 2), are kept without recomputation; selective recomputation redoes
    the attention core and keeps the rest, what a flash kernel's block keeps."""
    gpt = ModelConfig(layers=2, dim=512, ffn=2048, heads=8, kv_heads=8, vocab=256, mlp="gelu")
    flash = _tp2_work(gpt)
    materialized = dataclasses.replace(flash, attention="materialized")
    assert traffic(materialized).saved == traffic(flash).saved + 5 * 4 * SEQ
    selective = dataclasses.replace(materialized, recompute="selective")
    assert traffic(selective).saved == traffic(flash).saved


def test_the_loss_bytes_by_hand():
    """torch's cross-entropy per logit: log-softmax reads the logits twice (the max, then the sum of
    exponentials) and writes the log-probabilities, 12 B in FP32; backward, nll_loss writes their
    gradient (4), and log-softmax's backward reads it with them and writes the logits' (12); BF16
    logits add the cast to FP32 and back, 2 + 4 B each way. Held: the log-probabilities, their
    gradient and its cast to the logits' precision."""
    assert loss_bytes(4) == (12, 16, 12)
    assert loss_bytes(2) == (12 + 6, 16 + 6, 10)


def test_fp32_paths_of_the_count_by_hand():
    """FP32 (4 B activations and stream) where BF16's 2 B hides a slip of `2 *` for `2 **`: the debug block
    (h 64, 4 query heads and 2 K/V heads of 16, FFN 176), per token. The loss's logits need no cast in
    FP32: 12 B forward, 16 backward, 12 held."""
    assert loss_bytes(4) == (12, 16, 12)
    assert loss_bytes(2) == (18, 22, 10)
    h, q, kv, f, heads = 64, 64, 32, 176, 4
    fused = traffic(dataclasses.replace(_job(GQA, "fp32").work, fused=True))
    assert (
        fused.forward == 4 * (4 + 4) * h + 2 * 4 * (q + kv) + 3 * 4 * f
    )  # add-and-norms, RoPE, SwiGLU
    assert fused.backward == 1.5 * fused.forward
    # the stream and the branch of both norms, attention's inputs and output, SwiGLU's three, the
    # norms' outputs, attention's logsumexp
    assert fused.saved == 2 * 4 * h + 4 * (2 * q + 2 * kv) + 3 * 4 * f + 2 * 4 * h + 4 * heads
    # selective recomputation keeps the stream twice, every matmul output but wo's and w2's, attention's
    # output and its logsumexp
    selective = traffic(_job(GQA, "fp32", "selective").work)
    assert selective.saved == 2 * 4 * h + 4 * (q + kv + kv + f + f + q) + 4 * heads
    # K and V copied to every query head (torchtitan's repeat_kv): read K/V, write the copies, for both
    copied = traffic(dataclasses.replace(_job(GQA, "fp32").work, shared_kv=False))
    shared = traffic(_job(GQA, "fp32").work)
    assert copied.forward - shared.forward == 2 * 4 * (kv + heads * 16)


class _SizedBytes(TorchDispatchMode):
    """Bytes each memory-bound op reads and writes of tensors of exactly `elements` elements (the s × s
    scores of every head of every sequence; an FFN activation), matmuls apart; broadcast buffers and
    0-d tensors are not of that size."""

    def __init__(self, elements: int):
        super().__init__()
        self.elements = elements
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        is_view = any(
            ret.alias_info is not None and not ret.alias_info.is_write
            for ret in func._schema.returns
        )
        if is_view or str(func).startswith(NOT_COUNTED):
            return out
        seen = set()
        for tensor in tree_flatten((args, kwargs, out))[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != self.elements:
                continue
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype)
            if key not in seen:
                seen.add(key)
                self.bytes += tensor.numel() * tensor.element_size()
        return out


def _eager_attention(q, k, v, causal, autocast: bool):
    """Hugging Face's GPT2Attention._attn as CUDA autocast runs it: scale, causal where, softmax in
    FP32 (autocast casts its input first) cast back, dropout (torch's fused native_dropout, as
    nn.Dropout runs on CUDA), the values' matmul."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores / torch.full([], q.size(-1) ** 0.5, dtype=scores.dtype)
    scores = torch.where(causal, scores, torch.full([], -1e4, dtype=scores.dtype))
    probs = torch.softmax(scores.float() if autocast else scores, dim=-1).type(v.dtype)
    dropped, _ = torch.native_dropout(probs, 0.1, True)
    return torch.matmul(dropped, v)


@pytest.mark.parametrize("autocast", [True, False])
def test_eager_attention_moves_the_counted_bytes_per_score(autocast):
    """fourd.plan.block.score_bytes' eager count equals the score-sized bytes the ops read and
    write, forward and backward, in BF16 (with and without autocast's FP32 softmax)."""
    gpt = ModelConfig(layers=2, dim=64, ffn=256, heads=4, kv_heads=4, vocab=256, mlp="gelu")
    work = dataclasses.replace(
        _tp2_work(gpt), attention="eager", autocast=autocast, layout=Layout()
    )
    heads, head_dim = gpt.heads, gpt.head_dim
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(BATCH, heads, SEQ, head_dim, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None]
    scores = BATCH * heads * SEQ * SEQ
    with _SizedBytes(scores) as forward:
        out = _eager_attention(q, k, v, causal, autocast)
    with _SizedBytes(scores) as backward:
        out.float().sum().backward()
    per_score = score_bytes(work)
    assert forward.bytes == per_score.forward * scores
    assert backward.bytes == per_score.backward * scores
    # by hand: BF16 scores, FP32 softmax under autocast
    assert (per_score.forward, per_score.backward, per_score.kept) == (
        (33, 37, 7) if autocast else (17, 19, 5)
    )


def _gelu_new(x, autocast: bool):
    """Hugging Face's NewGELUActivation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), as CUDA autocast
    runs it: pow in FP32 (its input cast by a kernel of its own), so the rest in FP32, and the result
    cast back to BF16 for the next linear."""
    half = 0.5 * x
    cubed = torch.pow(x.float() if autocast else x, 3.0)
    out = half * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * cubed)))
    return out.to(x.dtype) if autocast else out


@pytest.mark.parametrize("autocast", [True, False])
def test_eager_gelu_new_moves_and_keeps_the_counted_bytes(autocast):
    """fourd.plan.block.gelu_new_bytes, with one GeLU kernel's 2b forward, 3b backward and b kept,
    equals the FFN-sized bytes the eight ops (and autocast's casts) read and write, forward and
    backward, and the FFN-sized tensors autograd keeps, in BF16."""
    gpt = ModelConfig(layers=2, dim=64, ffn=256, heads=4, kv_heads=4, vocab=256, mlp="gelu_new")
    work = dataclasses.replace(_tp2_work(gpt), autocast=autocast, layout=Layout())
    torch.manual_seed(0)
    x = torch.randn(TOKENS, gpt.ffn, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(TOKENS, gpt.ffn, dtype=torch.bfloat16)
    elements = x.numel()
    kept: dict = {}

    def keep(tensor):
        if tensor.numel() == elements:
            kept[(tensor.untyped_storage().data_ptr(), tensor.dtype)] = tensor.element_size()
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor)
    with hooks, _SizedBytes(elements) as forward:
        out = _gelu_new(x, autocast)
    with _SizedBytes(elements) as backward:
        out.backward(grad)
    more = gelu_new_bytes(sizes(work))
    b = 2
    assert forward.bytes == (more.forward + 2 * b) * elements
    assert backward.bytes == (more.backward + 3 * b) * elements
    assert sum(kept.values()) == more.kept + b
    # by hand: eight BF16 ops, or FP32 from pow on under autocast with its two casts
    assert (more.forward + 2 * b, more.backward + 3 * b, more.kept + b) == (
        (76, 118, 14) if autocast else (36, 56, 8)
    )


def test_an_eager_gelu_new_block_is_a_gelu_block_and_its_eight_ops():
    """The eager GPT block with gelu_new moves and keeps what one with GeLU does and gelu_new's
    bytes beyond one kernel, per FFN element (1,024 on this TP rank); recomputation keeps none of
    them and redoes them; a fused (compiled) block runs it as one kernel, as GeLU."""
    gelu = ModelConfig(layers=2, dim=512, ffn=2048, heads=8, kv_heads=8, vocab=256, mlp="gelu")
    gelu_new = dataclasses.replace(gelu, mlp="gelu_new")
    one, eight = _tp2_work(gelu), _tp2_work(gelu_new)
    more = gelu_new_bytes(sizes(eight))
    assert (more.forward, more.backward, more.kept) == (32, 50, 6)  # BF16, no autocast
    assert traffic(eight).forward == traffic(one).forward + 32 * 1024
    assert traffic(eight).backward == traffic(one).backward + 50 * 1024
    assert traffic(eight).saved == traffic(one).saved + 6 * 1024
    selective = dict(recompute="selective")
    assert (
        traffic(_tp2_work(gelu_new, **selective)).saved
        == traffic(_tp2_work(gelu, **selective)).saved
    )
    assert traffic(_tp2_work(gelu_new, **selective)).redo == (
        traffic(_tp2_work(gelu, **selective)).redo + 32 * 1024
    )
    fused = dict(fused=True)
    assert traffic(_tp2_work(gelu_new, **fused)) == traffic(_tp2_work(gelu, **fused))
