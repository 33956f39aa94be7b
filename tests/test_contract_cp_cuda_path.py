"""Context parallelism's CUDA path with grouped-query attention, run on CPU ranks.

On CUDA, ContextParallelAttention repeats the gathered K and V heads to every query head before the masked
attention kernel (fourd.parallel.cp.REPEAT_KV_ON); on a CPU the kernel takes the shared KV heads itself. Here
the CPU is added to REPEAT_KV_ON in each gloo rank, so the CUDA path's code runs with the CPU's kernel in
place of CUDA's: its logits, losses and trained weights at cp=2 must equal the one-process model's, as the
CPU path's do (tests/test_parallel_cp.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_util import run_ranks
from test_parallel_cp import CFG, _cp_run, _data, _train

from fourd.model.llama import build_model
from fourd.parallel import cp as cp_module

pytestmark = pytest.mark.slow  # gloo ranks


def _cuda_path_on_cpu(rank, world):
    cp_module.REPEAT_KV_ON.add("cpu")
    heads = []
    attention = F.scaled_dot_product_attention

    def seen(q, k, v, **kwargs):  # the heads the kernel is given: the query heads', K's and V's
        heads.append((q.shape[1], k.shape[1], v.shape[1]))
        return attention(q, k, v, **kwargs)

    F.scaled_dot_product_attention = seen
    try:
        run = _cp_run(rank, 2, dist.group.WORLD)
    finally:
        F.scaled_dot_product_attention = attention
    run["heads"] = sorted(set(heads))
    return run


@pytest.mark.timeout(180)
def test_cp2_with_kv_heads_repeated_as_on_cuda_equals_one_process():
    assert CFG.kv_heads < CFG.heads  # grouped-query attention: the path under test repeats K and V
    xs, ys = _data()
    ref_model = build_model(CFG, seed=0)
    with torch.no_grad():
        ref_logits = ref_model(xs[0])
    ref_losses, ref_params = _train(ref_model, xs, ys)
    for run in run_ranks(_cuda_path_on_cpu, 2, timeout=170):
        assert run["heads"] == [
            (CFG.heads, CFG.heads, CFG.heads)
        ]  # K, V repeated to every query head
        torch.testing.assert_close(run["logits"], ref_logits, rtol=1e-5, atol=1e-6)
        assert run["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for name, ref in ref_params.items():
            rel = ((run["params"][name] - ref).norm() / ref.norm()).item()
            assert rel < 1e-5, f"{name}: relative difference {rel:.2e}"
