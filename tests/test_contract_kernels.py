"""Kernel-time and search rules a one-line bug could break without moving the suite's rows: attention
on a GPU profile with no attention figures, and interleaving's microbatch floor in the search."""

import dataclasses

import pytest

from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.cluster import load_cluster
from fourd.plan.kernels import attention_time, gemm_time

H100 = load_cluster("dgx-h100")


def test_attention_without_kernel_figures_is_two_gemms_per_head_over_half_the_square_when_causal():
    bare = dataclasses.replace(
        H100, gpu=dataclasses.replace(H100.gpu, attention_fwd_efficiency=None, attention=())
    )
    tokens, heads, head_dim = 4096, 8, 128
    square = 2 * gemm_time(tokens, tokens, head_dim, bare) * heads
    causal_fwd, causal_bwd = attention_time(tokens, tokens, heads, head_dim, bare, causal=True)
    full_fwd, full_bwd = attention_time(tokens, tokens, heads, head_dim, bare, causal=False)
    assert full_fwd == pytest.approx(square, rel=1e-12)
    assert causal_fwd == pytest.approx(square / 2, rel=1e-12)
    assert causal_bwd / causal_fwd == pytest.approx(full_bwd / full_fwd, rel=1e-12)


def test_interleaving_is_searched_with_no_fewer_microbatches_than_stages_when_it_can_be():
    values = {"layout": "tp=8,pp=4,dp=1", "seq": 4096, "global_batch_tokens": 4 * 4096}
    plans = request.plans(request.resolve(get_preset("llama3-70b"), H100, values))
    interleaved = {
        plan.config.microbatches for plan in plans if plan.config.schedule == "interleaved"
    }
    assert interleaved == {4}  # 4 sequences: 4, 2 or 1 microbatches; with 4 ranks only 4
    assert {plan.config.microbatches for plan in plans if plan.config.schedule == "1f1b"} == {
        1,
        2,
        4,
    }
