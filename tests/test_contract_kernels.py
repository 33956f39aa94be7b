"""Planner rules a one-line bug could break without moving the suite's rows: attention on a GPU
profile with no attention figures, interleaving's microbatch floor in the search, a token batch
rounded to the nearest even split, ranks sharing one CPU server's cores, and the note for a schedule a
stack does not run on the smallest pipeline."""

import dataclasses

import pytest

from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.cluster import (
    AttentionSample,
    Cluster,
    CollectiveSample,
    GemmSample,
    Group,
    Network,
    Node,
    collective_latency,
    group_bandwidth,
    load_cluster,
)
from fourd.plan.kernels import (
    ADAM_BYTES,
    FA_BACKWARD_FLOPS,
    FA_HALF_LENGTH,
    HBM_EFFICIENCY,
    KERNEL_LAUNCH_S,
    attention_time,
    collective_time,
    elementwise_time,
    gemm_time,
    optimizer_time,
)
from fourd.plan.perf import exposed_layer_comm

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
    assert causal_bwd == pytest.approx(causal_fwd * FA_BACKWARD_FLOPS, rel=1e-12)
    assert full_bwd == pytest.approx(full_fwd * FA_BACKWARD_FLOPS, rel=1e-12)


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


def test_a_token_batch_goes_to_the_nearest_even_split_up_as_well_as_down(capsys):
    model, seqs = get_preset("llama3-8b"), 2048
    for dp, planned in ((96, 2016), (80, 2080)):  # 21.33 and 25.6 sequences per replica
        values = {"layout": f"dp={dp}", "seq": 4096, "global_batch_tokens": seqs * 4096}
        assert request.resolve(model, H100, values).base.global_seqs == planned
        assert capsys.readouterr().err == (
            f"fourd: note: {seqs} sequences do not split into {dp} equal parts: planned with "
            f"{planned}\n"
        )


def test_ranks_share_the_cores_of_their_own_server_only():
    cpu = Cluster(
        name="two-cores",
        description="",
        gpu=H100.gpu,
        node=Node(gpus=8, intra_bw_gbps=1.0, concurrent_ranks=2),
        network=Network(nic_bw_gbps=1.0),
    )
    assert [cpu.core_share(ranks) for ranks in (1, 2, 4, 8, 16, 64)] == [
        1.0,
        1.0,
        2.0,
        4.0,
        4.0,
        4.0,
    ]
    assert H100.core_share(64) == 1.0  # GPUs share nothing


def test_a_schedule_the_stack_lacks_is_noted_on_a_two_stage_pipeline(capsys):
    values = {"layout": "tp=8,pp=2,dp=4", "seq": 4096, "stack": "megatron-core"}
    request.resolve(get_preset("llama3-70b"), H100, values | {"schedule": "zero-bubble"})
    assert "megatron-core stack runs the schedules 1f1b, interleaved" in capsys.readouterr().err
    request.resolve(
        get_preset("llama3-70b"), H100, values | {"layout": "tp=8,dp=8", "schedule": "zero-bubble"}
    )
    assert capsys.readouterr().err == ""  # without a pipeline every schedule is the same


def test_full_recomputation_charges_the_forwards_tp_and_cp_collectives_twice():
    values = {"layout": "tp=4,cp=2,dp=1", "seq": 8192, "microbatches": 2}
    values |= {"global_batch_tokens": 2 * 8192, "sequence_parallel": False}
    model = get_preset("llama3-8b")
    plain = request.plans(request.resolve(model, H100, values | {"recompute": "none"}))[0]
    full = request.plans(request.resolve(model, H100, values | {"recompute": "full"}))[0]
    comm = exposed_layer_comm(full.job.work)
    assert comm == exposed_layer_comm(plain.job.work)
    runs = 2 * model.layers  # microbatches × layers
    assert plain.step.tp_comm_s == pytest.approx(runs * (comm.tp_forward + comm.tp_backward))
    assert full.step.tp_comm_s == pytest.approx(runs * (2 * comm.tp_forward + comm.tp_backward))
    assert full.step.cp_comm_s == pytest.approx(runs * (2 * comm.cp_forward + comm.cp_backward))
    assert comm.tp_forward > 0 and comm.cp_forward > 0


def test_fused_attention_runs_at_its_efficiency_times_l_over_l_plus_384():
    gpu = H100.gpu
    for kv_len in (512, 640, 4096):  # 640 shares a bit with 384: a sum, not a bitwise or
        fwd, bwd = attention_time(kv_len, kv_len, 8, 128, H100, causal=True)
        flops = 4.0 * kv_len * kv_len / 2 * 128 * 8
        rate = gpu.peak_tflops * 1e12 * kv_len / (kv_len + FA_HALF_LENGTH)
        assert fwd == pytest.approx(flops / (rate * gpu.attention_fwd_efficiency), rel=1e-12)
        bwd_rate = rate * (gpu.attention_bwd_efficiency or gpu.attention_fwd_efficiency)
        assert bwd == pytest.approx(flops * FA_BACKWARD_FLOPS / bwd_rate, rel=1e-12)


def test_a_thin_gemm_is_bound_by_its_three_matrices_bytes():
    m, n, k = 65536, 16, 65536  # a 65536 × 65536 matrix read once for 16 columns: memory-bound
    bytes_moved = 2 * (m * k + k * n + m * n)
    memory = bytes_moved / (H100.gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9)
    assert gemm_time(m, n, k, H100) == pytest.approx(memory + KERNEL_LAUNCH_S, rel=1e-12)


def test_adam_moves_its_bytes_per_parameter_at_hbm_efficiency():
    rate = H100.gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9
    for dtype_bytes in (2, 4):
        assert optimizer_time(1e9, H100, dtype_bytes) == pytest.approx(
            1e9 * ADAM_BYTES[dtype_bytes] / rate, rel=1e-12
        )


def test_a_collectives_latency_is_its_call_and_ring_or_tree_steps_and_nothing_moves_for_no_bytes():
    """NCCL's tuning model, as the GPU presets carry it: 8.4 µs a call, 3.4 µs a ring step on NVLink,
    14 µs one between servers."""
    node, net = H100.node, H100.network
    assert (node.call_latency_us, node.intra_latency_us, net.latency_us) == (8.4, 3.4, 14.0)
    call, nvlink = 8.4e-6, 3.4e-6
    inside = Group(4, 1, 8)
    bus_bw, _ = group_bandwidth(inside, H100)
    tiny = 1.0
    assert collective_time("all_gather", tiny, inside, H100) == pytest.approx(
        call + 3 * nvlink + 3 / 4 * tiny / bus_bw, rel=1e-12
    )
    assert collective_time("reduce_scatter", tiny, inside, H100) == pytest.approx(
        call + 3 * nvlink + 3 / 4 * tiny / bus_bw, rel=1e-12
    )
    pair = Group(2, 1, 8)
    pair_bw, _ = group_bandwidth(pair, H100)
    assert collective_time("all_reduce", tiny, pair, H100) == pytest.approx(
        call + 2 * nvlink + tiny / pair_bw, rel=1e-12
    )
    assert collective_time("all_gather", 0.0, inside, H100) == 0.0
    three = Group(3, 1, 8)  # a tree's 2·ceil(log2 3) = 4 steps
    three_bw, _ = group_bandwidth(three, H100)
    assert collective_time("all_reduce", tiny, three, H100) == pytest.approx(
        call + 4 * nvlink + 2 * 2 / 3 * tiny / three_bw, rel=1e-12
    )


def test_a_collective_across_servers_pays_the_networks_latency_on_the_steps_between_them():
    """Ranks 0, 4, ..., 60 of 64: two on each of 8 servers. A ring reduce-scatter or all-gather takes
    15 steps, 7 of them between servers; an all-reduce's tree 2·ceil(log2 16) = 8, 2·ceil(log2 8) = 6
    between servers; a send one, across."""
    call, nvlink, network = 8.4e-6, 3.4e-6, 14e-6
    spread = Group(16, 4, 64)
    assert collective_latency("reduce_scatter", spread, H100) == pytest.approx(
        call + 7 * network + 8 * nvlink, rel=1e-12
    )
    assert collective_latency("all_gather", spread, H100) == pytest.approx(
        call + 7 * network + 8 * nvlink, rel=1e-12
    )
    assert collective_latency("all_reduce", spread, H100) == pytest.approx(
        call + 6 * network + 2 * nvlink, rel=1e-12
    )
    assert collective_latency("send", Group(2, 8, 16), H100) == pytest.approx(
        call + network, rel=1e-12
    )
    assert collective_latency("send", Group(2, 1, 16), H100) == pytest.approx(
        call + nvlink, rel=1e-12
    )


def test_elementwise_bytes_move_at_hbm_efficiency():
    assert elementwise_time(1e9, H100) == pytest.approx(
        1e9 / (H100.gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9), rel=1e-12
    )


def test_measured_gemm_rates_are_interpolated_by_inverse_distance_to_the_fourth_power():
    """Two samples 2 and 8 TFLOP/s at 2^30 and 2^32 FLOPs: at 2^31 (log2 distance 1 from each) the
    weights are equal, at their own points each sample's rate, at 2^31.5 weights 1/1.5^4 and 1/0.5^4."""
    samples = (GemmSample(1024, 1024, 512, 2.0), GemmSample(2048, 2048, 512, 8.0))
    measured = dataclasses.replace(H100, gpu=dataclasses.replace(H100.gpu, gemm=samples))

    def rate(m, n, k):
        return 2 * m * n * k / gemm_time(m, n, k, measured) / 1e12

    assert rate(1024, 1024, 512) == pytest.approx(2.0)
    assert rate(2048, 2048, 512) == pytest.approx(8.0)
    assert rate(2048, 1024, 512) == pytest.approx(5.0)  # 2^31 FLOPs
    near, far = 1 / 0.5**4, 1 / 1.5**4
    assert rate(2048, 2048, 362) == pytest.approx(
        (near * 8.0 + far * 2.0) / (near + far), rel=1e-3
    )  # 2^31.5 FLOPs, k rounded


def test_a_measured_collective_fit_wins_and_a_send_uses_the_two_rank_fit():
    fits = (
        CollectiveSample("all_gather", 4, 1e-3, 1e-9),
        CollectiveSample("send", 2, 2e-3, 2e-9),
    )
    measured = dataclasses.replace(H100, collectives=fits)
    four = Group(4, 1, 8)
    assert collective_time("all_gather", 1e6, four, measured) == pytest.approx(1e-3 + 1e-3)
    assert collective_time("send", 1e6, four, measured) == pytest.approx(2e-3 + 2e-3)
    assert collective_time("reduce_scatter", 1e6, four, measured) == collective_time(
        "reduce_scatter", 1e6, four, H100
    )  # no fit for it: the ring model


def test_a_send_across_servers_drives_one_nic_each_end():
    across = Group(2, 8, 16)  # ranks 0 and 8: two servers
    one_nic, _ = group_bandwidth(across, H100, 1)
    assert collective_time("send", 1e9, across, H100) == pytest.approx(
        (8.4 + 14.0) * 1e-6 + 1e9 / one_nic, rel=1e-12
    )


def test_the_fit_for_this_op_and_this_group_size_is_used_whatever_the_order_of_the_fits():
    fits = (
        CollectiveSample("reduce_scatter", 4, 5e-3, 5e-9),
        CollectiveSample("all_gather", 8, 3e-3, 3e-9),
        CollectiveSample("all_gather", 4, 1e-3, 1e-9),
    )
    measured = dataclasses.replace(H100, collectives=fits)
    assert collective_time("all_gather", 1e6, Group(4, 1, 8), measured) == pytest.approx(2e-3)


def test_a_cpu_fit_measured_with_fewer_ranks_busy_is_slowed_by_the_ratio_of_core_shares():
    """Two ranks a server's two cores can run at once: a 2-rank fit used in a world of 3 busy
    ranks runs core_share(3) / core_share(2) = 1.5 / 1 times slower."""
    cpu = Cluster(
        name="two-core",
        description="",
        gpu=dataclasses.replace(H100.gpu, sms=None),
        node=Node(gpus=8, intra_bw_gbps=10.0, concurrent_ranks=2),
        network=Network(nic_bw_gbps=10.0),
        collectives=(CollectiveSample("all_reduce", 2, 1e-3, 1e-9),),
    )
    assert collective_time("all_reduce", 1e6, Group(2, 1, 3), cpu) == pytest.approx(1.5 * 2e-3)


def test_a_gpu_without_sms_or_samples_runs_a_gemm_at_its_sustained_rate_with_no_launch():
    gpu = dataclasses.replace(H100.gpu, sms=None)
    bare = dataclasses.replace(H100, gpu=gpu)
    flops = 2.0 * 4096**3
    assert gemm_time(4096, 4096, 4096, bare) == pytest.approx(
        flops / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency), rel=1e-12
    )


def test_unmasked_attention_uses_the_explicit_mask_rates_only_when_every_sample_has_both():
    tokens, heads, head_dim = 4096, 8, 128
    flops = 4.0 * tokens * tokens * head_dim * heads
    both = AttentionSample(tokens, head_dim, 100.0, 80.0, 50.0, 40.0)
    half = AttentionSample(tokens, head_dim, 100.0, 80.0, 50.0, None)
    for samples, (fwd_rate, bwd_rate) in (((both,), (50.0, 40.0)), ((half,), (100.0, 80.0))):
        profile = dataclasses.replace(H100, gpu=dataclasses.replace(H100.gpu, attention=samples))
        fwd, bwd = attention_time(tokens, tokens, heads, head_dim, profile, causal=False)
        assert fwd == pytest.approx(flops / (fwd_rate * 1e12), rel=1e-12)
        assert bwd == pytest.approx(flops * FA_BACKWARD_FLOPS / (bwd_rate * 1e12), rel=1e-12)
