"""Whole-run arithmetic, ring collectives, bubbles, ZeRO bytes and activations: the planner's pure functions
against figures worked out by hand and published formulas."""

import math

import pytest

from fourd.layout import Layout, Parallelism
from fourd.model.config import ModelConfig, get_preset
from fourd.plan.cluster import Group, load_cluster
from fourd.plan.job import Job
from fourd.plan.kernels import bus_factor, collective_time
from fourd.plan.memory import (
    activation_bytes_per_token,
    gpt_activation_bytes_per_layer,
    in_flight,
    min_gpus,
    state_bytes_per_param,
    training_state_bytes,
    weights_bytes,
)
from fourd.plan.perf import bubble_fraction, gpu_years, run_days, training_flops

H100 = load_cluster("llama3-h100")


def work(model, tp=1, recompute="none", sp=True):
    return Job(model, H100, Parallelism(Layout(tp=tp), recompute=recompute, sequence_parallel=sp), 2048, 1).work


def test_weights_state_and_fewest_gpus_of_405b():
    assert weights_bytes(405e9, 2) == 810e9
    assert training_state_bytes(405e9) == 6.48e12
    assert min_gpus(6.48e12, 80.0) == 81
    assert min_gpus(80e9 * 81 + 1, 80.0) == 82


def test_compute_budget_years_and_days():
    flops = training_flops(405e9, 15.6e12)
    assert round(flops / 1e25, 1) == 3.8
    assert round(gpu_years(3.8e25, 400e12), -2) == 3000
    assert round(run_days(3.8e25, 16384, 400e12)) == 67


def test_ring_all_reduce_bytes_and_time():
    assert bus_factor("all_reduce", 8) == 1.75
    assert round(bus_factor("all_reduce", 128), 2) == 1.98
    sent = bus_factor("all_reduce", 128) * 10e9
    assert round(sent / 1e9, 1) == 19.8
    assert round(sent / 50e9, 1) == 0.4
    assert round(sent / 450e9, 3) == 0.044


def _ideal_cluster(tmp_path, gpus_per_node):
    path = tmp_path / "ideal.toml"
    path.write_text(f"""
name = "ideal"
[gpu]
name = "x"
peak_tflops = 1.0
memory_gb = 80.0
hbm_bw_gbps = 1000.0
[node]
gpus = {gpus_per_node}
intra_bw_gbps = 450.0
intra_latency_us = 0.0
[network]
nic_bw_gbps = 50.0
latency_us = 0.0
gpus_per_pod = 1024
""")
    return load_cluster(str(path))


def test_ring_over_network_and_over_nvlink_through_collective_time(tmp_path):
    network = _ideal_cluster(tmp_path, 1)
    assert collective_time("all_reduce", 10e9, Group(128, 1, 128), network) == pytest.approx(0.396875)
    nvlink = _ideal_cluster(tmp_path, 128)
    assert round(collective_time("all_reduce", 10e9, Group(128, 1, 128), nvlink), 3) == 0.044


def test_gpipe_bubbles_at_p16():
    assert [bubble_fraction(16, m) for m in (16, 64, 128)] == [15 / 31, 15 / 79, 15 / 143]  # 48.4, 19.0, 10.5 %
    # interleaving V stages per rank divides the bubble (relative to compute) by V
    assert bubble_fraction(16, 16, 4) == 15 / 79


def test_zero_bytes_per_parameter():
    n = 64
    assert sum(state_bytes_per_param(0, n)) == 16
    assert sum(state_bytes_per_param(1, n)) == 4 + 12 / n
    assert sum(state_bytes_per_param(2, n)) == 2 + 14 / n
    assert sum(state_bytes_per_param(3, n)) == 16 / n
    assert sum(state_bytes_per_param(0, n, dtype_bytes=4)) == 16  # FP32: weights, grads, Adam m and v


def test_1f1b_holds_p_microbatches_gpipe_holds_m():
    assert [in_flight("gpipe", 4, 8, 1, r) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 2, 1, r) for r in range(4)] == [2, 2, 2, 1]
    # interleaved: the rank-0 warm-up of (V-1)·p + 2(p-1) stages and one more, each 1/V of the layers
    assert in_flight("interleaved", 16, 32, 8, 0) == (7 * 16 + 30 + 1) / 8


def test_activation_bytes_match_korthikanti_for_a_gpt_block_without_dropout():
    # A GPT block: GeLU MLP of 4h, multi-head attention. Korthikanti et al. count 2 sbh of dropout masks
    # that our blocks do not have; with flash attention the 5as/h term is gone; we keep a logsumexp per head.
    h, a, s = 4096, 32, 2048
    gpt = ModelConfig(layers=1, dim=h, ffn=4 * h, heads=a, kv_heads=a, vocab=1000, mlp="gelu")
    lse = 4 * a
    for t, sp in ((1, False), (8, False), (8, True)):
        ours = s * activation_bytes_per_token(work(gpt, t, sp=sp))
        theirs = gpt_activation_bytes_per_layer(s, 1, h, a, t, sequence_parallel=sp, flash=True)
        masks = 2 * s * h / (t if sp else 1)
        assert ours == pytest.approx(theirs - masks + s * lse / t)
    assert gpt_activation_bytes_per_layer(s, 1, h, a) == s * h * (34 + 5 * a * s / h)


def test_recomputation_keeps_less():
    m = get_preset("llama3-405b")
    none, sel, full = (activation_bytes_per_token(work(m, 8, rc)) for rc in ("none", "selective", "full"))
    assert full == m.dim * 2 / 8
    assert none - sel == (2 * m.dim + m.ffn) * 2 / 8
    assert math.isclose(none, (4 * m.dim + 2 * m.heads * 128 + 2 * 8 * 128 + 3 * m.ffn) * 2 / 8 + 4 * m.heads / 8)
