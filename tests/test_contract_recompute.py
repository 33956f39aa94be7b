"""Recomputation `per-op` recomputes exactly the matmuls the planner charges, and keeps what it counts.

The trainer's policy (fourd.parallel.recompute: keep the 1st, 3rd, ... matmul of a block, recompute the others)
is run on the debug model's blocks; its matmuls are recorded as they run, forward, recomputation and backward
together, and the shapes `per-op` runs beyond `none` are the recomputed ones. The planner charges them three
times: in the kept bytes (fourd.plan.block.traffic), in the backward's time (fourd.plan.perf.layer_time) and
in the hardware FLOPs (Plan.hw_tflops_per_gpu). In the debug model (dim 64, 2 of 4 heads' K and V, FFN 176) the
two halves differ, so keeping the other half changes every figure."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_parallel_recompute import CFG, _kept_per_token_per_layer, _planned
from torch.utils._python_dispatch import TorchDispatchMode

from fourd.layout import Layout, Parallelism
from fourd.model.llama import build_model
from fourd.parallel.recompute import apply_recompute
from fourd.plan.block import traffic
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.kernels import elementwise_time, gemm_time
from fourd.plan.perf import layer_time
from fourd.plan.search import evaluate

BATCH, SEQ = 2, 64
CLUSTER = load_cluster("llama3-h100")


class _Matmuls(TorchDispatchMode):
    """(m, k, n) of every aten.mm that runs, (m×k)·(k×n)."""

    def __init__(self):
        super().__init__()
        self.shapes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            (m, k), (_, n) = args[0].shape, args[1].shape
            self.shapes[(m, k, n)] += 1
        return func(*args, **(kwargs or {}))


def _matmuls(mode: str) -> Counter:
    """Every matmul of one block's forward, recomputation and backward (the first block of the debug model)."""
    model = apply_recompute(build_model(CFG, seed=0), mode)
    block = model.layers["0"]
    x = torch.randn(BATCH, SEQ, CFG.dim, requires_grad=True)
    cos, sin = model.rope(SEQ)
    with _Matmuls() as seen:
        block(x, cos, sin).sum().backward()
    return seen.shapes


def _job(mode: str) -> Job:
    par = Parallelism(layout=Layout(), recompute=mode)
    return Job(model=CFG, cluster=CLUSTER, par=par, seq=SEQ, global_seqs=BATCH, precision="fp32")


@pytest.fixture(scope="module")
def recomputed() -> Counter:
    """The matmuls per-op runs again in backward: (tokens, k, n) with their counts."""
    extra = _matmuls("per-op") - _matmuls("none")
    assert sum((_matmuls("none") - _matmuls("per-op")).values()) == 0
    return extra


def test_per_op_recomputes_wk_wo_and_w3(recomputed):
    tokens, h, kv, f = BATCH * SEQ, CFG.dim, CFG.kv_heads * CFG.head_dim, CFG.ffn
    # the 2nd, 4th and 6th of wq, wk, wv, wo, w1, w3, w2
    assert recomputed == Counter({(tokens, h, kv): 1, (tokens, h, h): 1, (tokens, h, f): 1})


def test_per_op_keeps_the_bytes_the_planner_counts():
    assert _kept_per_token_per_layer(CFG, "per-op") == _planned(CFG, "per-op")
    # FP32: the norms' input, wq's, wv's, w1's and w2's outputs, attention's output and log-sum-exp
    assert _planned(CFG, "per-op") == 4 * (64 + 64 + 32 + 176 + 64 + 64) + 4 * 4


def test_planner_charges_the_recomputed_matmuls_in_backward_time(recomputed):
    """layer_time's backward under per-op: none's, plus the recomputed GEMMs and the redone memory-bound work."""
    work, plain = _job("per-op").work, _job("none").work
    extra = sum(
        count * gemm_time(m, n, k, CLUSTER, 4) for (m, k, n), count in recomputed.items()
    ) + elementwise_time(work.tokens * traffic(work).redo, CLUSTER)
    got = layer_time(work).backward - layer_time(plain).backward
    assert got == pytest.approx(extra, rel=1e-12)


def test_planner_counts_the_recomputed_flops_in_hardware_flops(recomputed):
    """hw_tflops_per_gpu / tflops_per_gpu − 1 = the recomputed FLOPs over the model's, per token."""
    flops = sum(2 * m * k * n * count for (m, k, n), count in recomputed.items())
    per_token = flops / (BATCH * SEQ) * CFG.layers
    plan = evaluate(_job("per-op"))
    ratio = plan.hw_tflops_per_gpu / plan.tflops_per_gpu - 1
    assert ratio == pytest.approx(per_token / CFG.flops_per_token(SEQ), rel=1e-12)
    assert per_token == 4 * 2 * (64 * 32 + 64 * 64 + 64 * 176)
