"""Ring collectives, bubbles, ZeRO bytes and activations: the planner's pure functions against figures
worked out by hand and published formulas."""

import pytest

from fourd.comm import bus_factor
from fourd.layout import Layout, Parallelism
from fourd.model.config import ModelConfig, get_preset
from fourd.plan.block import traffic
from fourd.plan.cluster import Group, load_cluster
from fourd.plan.job import Job
from fourd.plan.kernels import collective_time
from fourd.plan.memory import in_flight, state_bytes_per_param

H100 = load_cluster("llama3-h100")


def work(model, tp=1, recompute="none", sp=True, attention="flash", seq=2048, dp=2):
    """One microbatch of one sequence, BF16 weights of a data-parallel wrapper (dp > 1), eager blocks."""
    par = Parallelism(layout=Layout(tp=tp, dp=dp), recompute=recompute, sequence_parallel=sp)
    return Job(model, H100, par, seq, dp, attention=attention).work


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
    assert collective_time("all_reduce", 10e9, Group(128, 1, 128), network) == pytest.approx(
        0.396875
    )
    nvlink = _ideal_cluster(tmp_path, 128)
    assert round(collective_time("all_reduce", 10e9, Group(128, 1, 128), nvlink), 3) == 0.044


def test_zero_bytes_per_parameter():
    n = 64
    assert sum(state_bytes_per_param(0, n)) == 16  # 405B: 6.48 TB of training state
    assert sum(state_bytes_per_param(1, n)) == 4 + 12 / n
    assert sum(state_bytes_per_param(2, n)) == 2 + 14 / n
    assert sum(state_bytes_per_param(3, n)) == 16 / n
    assert (
        sum(state_bytes_per_param(0, n, dtype_bytes=4)) == 16
    )  # FP32: weights, grads, Adam m and v


def test_1f1b_holds_p_microbatches_gpipe_holds_m():
    assert [in_flight("gpipe", 4, 8, 1, r) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 2, 1, r) for r in range(4)] == [2, 2, 2, 1]
    # interleaved: the rank-0 warm-up of (V-1)·p + 2(p-1) stages and one more, each 1/V of the layers
    assert in_flight("interleaved", 16, 32, 8, 0) == (7 * 16 + 30 + 1) / 8


def test_a_megatron_gpt_block_keeps_korthikantis_34_sbh_and_5_as2b():
    # Korthikanti et al. 2022 eq. 1-2, 16-bit GPT layer: sbh·34 + 5·a·s²·b with no parallelism,
    # sbh·(10 + 24/t) + 5·a·s²·b/t with TP. fourd's block has no dropout (their 2·sbh of masks) and keeps
    # attention's logsumexp (4 B per head); it keeps the scores' 5 bytes per pair like theirs.
    h, a, s = 4096, 32, 2048
    gpt = ModelConfig(layers=1, dim=h, ffn=4 * h, heads=a, kv_heads=a, vocab=1000, mlp="gelu")
    for t in (1, 8):
        ours = s * traffic(work(gpt, t, sp=False, attention="materialized")).saved
        theirs = s * h * (10 + 24 / t) + 5 * a * s * s / t if t > 1 else s * h * 34 + 5 * a * s * s
        assert ours == pytest.approx(
            theirs - 2 * s * h + s * 4 * a / t
        )  # the two dropout masks are not cut by TP
    # with sequence parallelism everything is cut by t (their eq. 4): sbh/t·34
    ours = s * traffic(work(gpt, 8, sp=True, attention="materialized")).saved
    assert ours == pytest.approx(s * h / 8 * 34 + 5 * a * s * s / 8 - 2 * s * h / 8 + s * 4 * a / 8)


def test_recomputation_keeps_less():
    m = get_preset("llama3-405b")
    none, sel, per_op, full = (
        traffic(work(m, 8, rc)).saved for rc in ("none", "selective", "per-op", "full")
    )
    assert full == m.dim * 2 / 8  # the layer's input, its sequence-parallel shard
    assert none > sel > per_op > full
    # per-op keeps the input, the outputs of wq, wv, w1 and w2 (every other matmul) and attention's output
    shard = m.dim // 8
    assert per_op == 2 * (shard + 16 * 128 + 128 + 53248 // 8 + shard + 16 * 128) + 4 * 16
    # selective keeps the two norms' inputs, Q, K, V, attention's output and the w1 and w3 outputs (fourd's policy)
    assert sel == 2 * 2 * shard + 2 * (16 * 128 + 2 * 128 + 16 * 128 + 2 * 53248 // 8) + 4 * 16
