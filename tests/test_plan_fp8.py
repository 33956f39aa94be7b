"""FP8 training in the planner (`--dtype fp8`, Transformer Engine's recipe): the layers' GEMMs at the FP8
rate by the documented formula, the casts and transposes it adds counted by hand, the FP8 weight copies in
memory, everything else as BF16, MFU against the FP8 peak, and the refusal where a GPU has no FP8."""

import dataclasses
import json
import math

import pytest
from conftest import run_fourd

from fourd.layout import Layout, Parallelism
from fourd.model.config import parse_model_spec
from fourd.plan.block import fp8_bytes, fp8_kept_savings, traffic
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.kernels import (
    GEMM_K_OVERHEAD,
    HBM_EFFICIENCY,
    KERNEL_LAUNCH_S,
    collective_time,
    gemm_time,
)
from fourd.plan.memory import peak_memory
from fourd.plan.perf import layer_comm, layer_gemms, sp_collectives, step_time

H100 = load_cluster("dgx-h100")
GQA = parse_model_spec("layers=4,dim=4096,ffn=14336,heads=32,kv_heads=8,vocab=32000")
GPT = parse_model_spec("layers=4,dim=4096,ffn=16384,heads=32,kv_heads=32,vocab=32000,mlp=gelu")


def _job(model, precision: str, tp: int = 2) -> Job:
    par = Parallelism(layout=Layout(tp, 1, 1, 8 // tp), microbatches=4, sequence_parallel=True)
    return Job(model, H100, par, 4096, 8 * 4 // tp, precision=precision, stack="nemo")


def test_an_fp8_gemm_follows_the_documented_formula():
    """8192 × 8192 × 8192: the best tile's waves (2,048 tiles of 128 × 256 in 16 waves of 132 SMs, 97 % of
    the slots), and a tile's prologue worth GEMM_K_OVERHEAD · 1979/989 steps of k at the FP8 rate."""
    gpu = H100.gpu
    m = n = k = 8192
    waves = max(
        m
        * n
        / (rows * cols * gpu.sms * math.ceil(math.ceil(m / rows) * math.ceil(n / cols) / gpu.sms))
        for rows, cols in ((128, 128), (128, 256), (256, 128))
    )
    util = waves * k / (k + GEMM_K_OVERHEAD * 1979.0 / 989.0)
    compute = 2.0 * m * n * k / (1979e12 * gpu.gemm_efficiency * util)
    memory = (m * k + k * n + 2 * m * n) / (gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9)
    assert gemm_time(m, n, k, H100, 2, fp8=True) == pytest.approx(
        max(compute, memory) + KERNEL_LAUNCH_S, rel=1e-12
    )
    bf16 = gemm_time(m, n, k, H100, 2)
    assert (
        0.5 < gemm_time(m, n, k, H100, 2, fp8=True) / bf16 < 0.56
    )  # twice the rate, a longer prologue


def test_the_backwards_fp8_gemms_run_at_the_measured_share_and_the_forwards_at_bf16s():
    """Transformer Engine accumulates the forward's FP8 GEMMs fast and the backward's in split steps;
    the latter run at the GPU's fp8_gemm_share of the BF16 efficiency, Bekman's measured FP8 share of
    its peak over BF16's (H100 SXM: 1,402.6 of 1,979 and 794.5 of 989 TFLOP/s)."""
    gpu = H100.gpu
    assert gpu.fp8_gemm_share == round((1402.6 / 1979) / (794.5 / 989), 3) == 0.882
    m = n = k = 8192  # compute-bound: the rate alone sets the time
    fast = gemm_time(m, n, k, H100, 2, fp8=True) - KERNEL_LAUNCH_S
    split = gemm_time(m, n, k, H100, 2, fp8=True, split_accumulator=True) - KERNEL_LAUNCH_S
    assert split == pytest.approx(fast / 0.882, rel=1e-12)
    # a layer's forward keeps BF16's efficiency; its input and weight gradients take the share
    work = _job(GQA, "fp8").work
    as_bf16 = dataclasses.replace(H100, gpu=dataclasses.replace(gpu, fp8_gemm_share=1.0))
    fwd, dgrad, wgrad = layer_gemms(work)
    fwd1, dgrad1, wgrad1 = layer_gemms(dataclasses.replace(work, cluster=as_bf16))
    assert fwd == fwd1
    assert dgrad / dgrad1 == pytest.approx(1 / 0.882, rel=0.01)
    assert wgrad / wgrad1 == pytest.approx(1 / 0.882, rel=0.01)
    # Blackwell's measured shares are near 1
    assert [load_cluster(name).gpu.fp8_gemm_share for name in ("dgx-b200", "dgx-gb200")] == [
        0.984,
        0.992,
    ]


def test_the_casts_fp8_adds_are_counted_by_hand():
    """Per token on one of 2 TP ranks, SwiGLU with GQA: q = 2048, kv = 512, h = 4096, f = 7168.
    Forward: the attention output cast with its transpose, 4·q. Backward: three transposes
    2·(2·h + f) and the output gradients of QKV, wo, w1, w3 and w2 cast with theirs, 4 B each."""
    q, kv, h, f = 2048, 512, 4096, 7168
    work = _job(GQA, "fp8").work
    assert fp8_bytes(work) == (4 * q, 2 * (2 * h + f) + 4 * ((q + 2 * kv) + 2 * h + 2 * f))
    gpt = _job(GPT, "fp8").work  # one w1: f = 8192
    assert fp8_bytes(gpt)[1] == 2 * (2 * h + 8192) + 4 * ((2048 + 2 * 2048) + 2 * h + 8192)
    plain, cast = traffic(_job(GQA, "bf16").work), traffic(work)
    assert (cast.forward - plain.forward, cast.backward - plain.backward) == fp8_bytes(work)
    # kept for the weight gradients in FP8: the two norms' outputs (SP shards of 2,048), wo's and w2's inputs
    assert plain.saved - cast.saved == (2 * 2048 + q + f) * (2 - 1)


def test_fp8_gathers_the_sequence_parallel_activations_in_one_byte_and_reduces_in_two():
    """Transformer Engine casts a column-parallel layer's input and a row-parallel layer's output
    gradient to FP8 before gathering them: SP's all-gathers move 1 B an element, its
    reduce-scatters the BF16 outputs; without SP the all-reduces stay BF16."""
    bf16, fp8 = _job(GQA, "bf16"), _job(GQA, "fp8")
    tp, cluster = fp8.work.groups["tp"], fp8.work.cluster
    act = fp8.work.tokens * GQA.dim
    gather = collective_time("all_gather", act * 1, tp, cluster)
    scatter = collective_time("reduce_scatter", act * 2, tp, cluster)
    assert sp_collectives(fp8.work) == (gather, scatter)
    assert sp_collectives(bf16.work) == (
        collective_time("all_gather", act * 2, tp, cluster),
        scatter,
    )
    assert layer_comm(fp8.work)[:2] == (2 * (gather + scatter), 4 * gather + 2 * scatter)
    assert gather < sp_collectives(bf16.work)[0]
    no_sp = [
        dataclasses.replace(job, par=dataclasses.replace(job.par, sequence_parallel=False))
        for job in (bf16, fp8)
    ]
    assert layer_comm(no_sp[1].work) == layer_comm(no_sp[0].work)


def test_fp8_changes_the_gemms_their_casts_and_sps_gathers_and_nothing_else():
    bf16, fp8 = _job(GQA, "bf16"), _job(GQA, "fp8")
    assert (bf16.dtype_bytes, fp8.dtype_bytes) == (2, 2)
    assert layer_comm(fp8.work)[2:] == layer_comm(bf16.work)[2:]  # CP traffic in BF16
    assert all(0.45 < a / b < 0.75 for a, b in zip(layer_gemms(fp8.work), layer_gemms(bf16.work)))
    t_bf16, t_fp8 = step_time(bf16), step_time(fp8)
    assert t_fp8.optimizer_s == t_bf16.optimizer_s and t_fp8.dp_total_s == t_bf16.dp_total_s
    assert t_fp8.step_s < t_bf16.step_s


def test_fp8_keeps_whole_weights_twice_more_in_one_byte_and_linear_inputs_in_one():
    """ZeRO 1 holds every weight whole: each linear weight gets an FP8 copy and its transpose, 2 B; ZeRO 3
    gathers one layer at a time and keeps none. Activations: one microbatch of 4,096 tokens in flight,
    each layer keeping its linear inputs at 1 B instead of 2 (fp8_kept_savings)."""
    bf16, fp8 = peak_memory(_job(GQA, "bf16"))[1], peak_memory(_job(GQA, "fp8"))[1]
    copies = GQA.layer_matrix_params() / 2 * GQA.layers * 2  # FP8 and transposed, 1 B each, tp 2
    assert fp8.other - bf16.other == pytest.approx(copies, rel=1e-12)
    kept_less = GQA.layers * 4096 * fp8_kept_savings(_job(GQA, "fp8").work)
    assert bf16.activations - fp8.activations == pytest.approx(kept_less, rel=1e-12)
    assert (fp8.params, fp8.grads, fp8.optimizer) == (bf16.params, bf16.grads, bf16.optimizer)
    sharded = [
        peak_memory(dataclasses.replace(job, par=dataclasses.replace(job.par, zero=3)))[1]
        for job in (_job(GQA, "bf16"), _job(GQA, "fp8"))
    ]
    assert sharded[1].other == sharded[0].other


def test_fourd_plan_dtype_fp8_reports_mfu_against_the_fp8_peak(tmp_path):
    common = [
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "8",
        "--layout",
        "tp=1,cp=1,pp=1,dp=8",
        "--stack",
        "nemo",
        "--json",
    ]
    fp8 = json.loads(run_fourd(*common, "--dtype", "fp8")[1])
    bf16 = json.loads(run_fourd(*common, "--dtype", "bf16")[1])
    assert (fp8["dtype"], fp8["peak_tflops"], bf16["peak_tflops"]) == ("fp8", 1979.0, 989.0)
    assert fp8["mfu"] == pytest.approx(fp8["tflops_per_gpu"] / 1979.0, rel=1e-12)
    assert fp8["step_time_s"] < bf16["step_time_s"]
    text = run_fourd(*common[:-1], "--dtype", "fp8")[1]
    assert "(llama3-h100, FP8)" in text and "MFU (of 1979 TFLOP/s peak)" in text


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused_in_one_line():
    code, _, err = run_fourd(
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "8",
        "--cluster",
        "dgx-a100-40gb",
        "--dtype",
        "fp8",
    )
    assert code == 2
    assert err.strip().splitlines() == [
        "fourd: error: --dtype fp8: the A100 SXM4 40GB of profile dgx-a100-40gb has no FP8 tensor "
        "cores (its profile gives no fp8_peak_tflops): plan with --dtype bf16, or on a profile of an "
        "FP8 GPU (aws-p5, dgx-b200, dgx-gb200, dgx-h100, dgx-h200, grand-teton-h100, hgx-h800, llama3-h100)"
    ]
