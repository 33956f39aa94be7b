"""The planner's time and memory model: kernels, placement, schedules, and Llama 3 Table 4."""

import dataclasses
from fractions import Fraction

import pytest

from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism
from fourd.model.config import ModelConfig, get_preset, with_overrides
from fourd.plan import request
from fourd.plan.cluster import (
    Group,
    group_bandwidth,
    group_level,
    group_levels,
    load_cluster,
    members_per_node,
    placement,
)
from fourd.plan.job import Job, cost_split, stage_layers
from fourd.plan.kernels import (
    GEMM_K_OVERHEAD,
    HBM_EFFICIENCY,
    KERNEL_LAUNCH_S,
    collective_time,
    gemm_time,
)
from fourd.plan.memory import in_flight, max_rank_params
from fourd.plan.perf import StageTime, bubble_time, chunk_times, layer_comm, stage_time, step_time
from fourd.plan.report import why
from fourd.plan.search import evaluate
from fourd.schedules import build_schedule
from fourd.sim.step import simulate, simulate_step

H100 = load_cluster("llama3-h100")
L405 = get_preset("llama3-405b")
TABLE4 = [
    (Layout(8, 1, 16, 64), 8192, 0.43),
    (Layout(8, 1, 16, 128), 8192, 0.41),
    (Layout(8, 16, 16, 8), 131072, 0.38),
]


def job(model, cluster, layout, seq, global_seqs, *settings, sp=True):
    """A Job with Parallelism(layout, schedule, microbatches, virtual_stages, zero, recompute) from `settings`."""
    return Job(
        model,
        cluster,
        Parallelism(
            layout=layout,
            **dict(
                zip(("schedule", "microbatches", "virtual_stages", "zero", "recompute"), settings)
            ),
            sequence_parallel=sp,
        ),
        seq,
        global_seqs,
    )


def _table4(layout, seq):
    """Table 4 as `fourd plan --schedule interleaved` asks it: the rest (V, m, ZeRO, recompute, compile) chosen."""
    return request.best_plan(
        L405, H100, layout.world, seq, 2**24 // seq, {"layout": layout, "schedule": "interleaved"}
    )


@pytest.mark.parametrize("layout,seq,mfu", TABLE4)
def test_llama3_table4_rows_within_two_points(layout, seq, mfu):
    plan = _table4(layout, seq)
    assert plan.fits
    assert abs(plan.mfu - mfu) <= 0.02


def test_the_drop_from_43_to_41_is_the_bubble_of_half_the_microbatches():
    a, b = _table4(*TABLE4[0][:2]), _table4(*TABLE4[1][:2])
    assert (a.config.microbatches, b.config.microbatches) == (32, 16)
    # same work per microbatch; the bubble relative to compute doubles: 15/(8·32) -> 15/(8·16) at the
    # slowest rank's pace, a little less through the lighter first and last ranks (one layer fewer each)
    from fourd.plan.perf import fill_and_drain_saving

    assert a.step.per_microbatch == b.step.per_microbatch
    for plan, share in ((a, 15 / 256), (b, 15 / 128)):
        saving = fill_and_drain_saving(plan.job)
        assert 0 < saving < 0.02 * plan.step.bubble_s
        assert (plan.step.bubble_s + saving) / plan.step.compute_s == pytest.approx(share)
    text = " ".join(why(b))
    assert "16 microbatches" in text and f"MFU {100 * a.mfu:.1f} %" in text


def test_gemm_waves_tiles_and_roofline():
    peak = H100.gpu.peak_tflops * 1e12 * H100.gpu.gemm_efficiency
    m, n, k = 12 * 128, 11 * 128, 8192  # 132 output tiles of 128x128: every SM busy once
    tile = k / (k + GEMM_K_OVERHEAD)  # each tile's prologue and epilogue
    assert gemm_time(m, n, k, H100) == pytest.approx(
        2 * m * n * k / (peak * tile) + KERNEL_LAUNCH_S
    )
    # one row more needs a second wave: as slow as twice the work
    assert gemm_time(m + 1, n, k, H100) == pytest.approx(gemm_time(2 * m, n, k, H100))
    # a matrix-vector product is bound by HBM bandwidth
    n = k = 16384
    assert gemm_time(1, n, k, H100) == pytest.approx(
        2 * (k + n * k + n) / (3350e9 * HBM_EFFICIENCY) + KERNEL_LAUNCH_S
    )


def test_placement_of_table4_groups():
    levels = {d: group_level(g, H100) for d, g in placement(Layout(8, 1, 16, 128)).items()}
    assert levels == {"tp": "nvlink", "cp": "single", "pp": "pod", "dp": "cross-pod"}
    assert {d: group_level(g, H100) for d, g in placement(Layout(8, 16, 16, 8)).items()}[
        "cp"
    ] == "pod"
    assert group_level(Group(2, 8, 16), H100) == "rack"


def test_groups_that_straddle_servers_are_charged_at_the_nics():
    # tp=3 on 8-GPU servers, 16 per rack: {6,7,8} spans two servers, {15,16,17} two racks, one member alone
    tp3 = Group(3, 1, 24)
    assert group_levels(tp3, H100) == {"nvlink": 6, "rack": 1, "pod": 1}
    assert (group_level(tp3, H100), members_per_node(tp3, H100)) == ("pod", 1)
    nic = H100.network.nic_bw_gbps * 1e9 * H100.network.nic_efficiency
    assert group_bandwidth(tp3, H100)[0] == pytest.approx(nic)  # one NIC carries the ring across
    # tp=6: pieces of 2 and 4 on two servers; the pair's two NICs carry the ring
    assert members_per_node(Group(6, 1, 48), H100) == 2
    # regular groups keep every member per server: 16 ranks on two servers drive 8 NICs each
    assert (group_level(Group(16, 1, 32), H100), members_per_node(Group(16, 1, 32), H100)) == (
        "rack",
        8,
    )
    lay = Layout(3, 1, 1, 8)
    straddled = job(get_preset("small"), H100, lay, 1024, 8, "1f1b", 1, 1, 1, "none", sp=False)
    inside = job(
        get_preset("small"), H100, Layout(2, 1, 1, 8), 1024, 8, "1f1b", 1, 1, 1, "none", sp=False
    )
    assert layer_comm(straddled.work)[0] > 3 * layer_comm(inside.work)[0]


def test_blocking_pipeline_comm_waits_for_every_send_and_the_gradient_reduction():
    base = job(L405, H100, Layout(8, 1, 16, 8), 8192, 128, "1f1b", 16, 1, 1, "none")
    overlapped, blocking = (
        step_time(base),
        step_time(dataclasses.replace(base, pipeline_comm="blocking")),
    )
    # every backward also adds its BF16 weight gradients into FP32 ones (2 + 4 + 4 B per parameter of the rank),
    # a pass over HBM of its own: 16 microbatches in the compute, 15 stage times in the bubble
    accumulate = (
        10 * max_rank_params(L405, 16, 1, 8) / (H100.gpu.hbm_bw_gbps * HBM_EFFICIENCY * 1e9)
    )
    assert blocking.compute_s == pytest.approx(overlapped.compute_s + 16 * accumulate)
    assert blocking.bubble_s == pytest.approx(overlapped.bubble_s + 15 * accumulate)
    # the 2(p−1) sends of warm-up and cool-down, and a middle rank's four for each microbatch after the first
    one = overlapped.p2p_s / (2 * 15)
    assert blocking.p2p_s == pytest.approx(
        (2 * 15 + 4 * 15) * one
    )  # with SP each TP rank sends its shard alike
    assert blocking.dp_exposed_s == blocking.dp_total_s > overlapped.dp_exposed_s
    with pytest.raises(FourdError, match="overlapped pipeline communication only"):
        simulate_step(dataclasses.replace(base, pipeline_comm="blocking"))


def test_cross_pod_groups_share_oversubscribed_uplinks(tmp_path):
    text = tmp_path / "base.toml"
    text.write_text("""
[gpu]
name = "x"
peak_tflops = 100.0
memory_gb = 80.0
hbm_bw_gbps = 1000.0
[node]
gpus = 8
intra_bw_gbps = 450.0
[network]
nic_bw_gbps = 50.0
latency_us = 0.0
gpus_per_rack = 16
gpus_per_pod = 16
cross_pod_oversubscription = 7.0
""")
    c = load_cluster(str(text))
    inside = Group(2, 8, 64)  # two servers of one rack, at NIC speed
    across = Group(2, 16, 64)  # two pods: 16 such groups per pod share its 16·50/7 GB/s of uplink
    assert group_bandwidth(inside, c)[0] == 50e9
    assert group_bandwidth(across, c)[0] == pytest.approx(50e9 / 7)
    assert collective_time("all_gather", 1e9, across, c) == pytest.approx(
        7 * collective_time("all_gather", 1e9, inside, c)
    )


def test_bubble_per_schedule():
    t = StageTime(1.0, 1.0, 1.0, 0.0, 0.0)
    assert bubble_time("gpipe", 4, 8, 1, t) == 9.0
    assert bubble_time("1f1b", 4, 8, 1, t) == 9.0
    assert bubble_time("interleaved", 4, 8, 3, t) == 3.0
    assert (
        bubble_time("zero-bubble", 4, 8, 1, t) == 3.0
    )  # (p−1)(T_F + T_I − T_W), a third of 1F1B's


def test_interleaved_bubble_is_exact_for_every_microbatch_count_fewer_than_p_included():
    # equal stages of F = 1, B = 2 per virtual stage: t_f + t_b = 3·V per rank, as Fractions so equal is equal
    for p in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in range(1, 2 * p + 2):
                r = simulate(build_schedule("interleaved", p, m, v), [{"F": 1, "B": 2}] * (p * v))
                whole = StageTime(
                    Fraction(v), Fraction(2 * v), Fraction(0), Fraction(0), Fraction(0)
                )
                assert r.step_time_s - 3 * v * m == bubble_time("interleaved", p, m, v, whole), (
                    p,
                    v,
                    m,
                )


def test_closed_forms_agree_with_the_schedule_action_lists():
    for name, vs in (
        ("gpipe", (1,)),
        ("1f1b", (1,)),
        ("zero-bubble", (1,)),
        ("interleaved", (2, 3, 4)),
    ):
        for pp in (2, 3, 4, 8):
            for m in (1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 2):
                for v in vs:
                    s = build_schedule(name, pp, m, v)
                    assert [s.peak_in_flight(r) / v for r in range(pp)] == [
                        in_flight(name, pp, m, v, r) for r in range(pp)
                    ]


def _layers(count: int):
    return with_overrides(L405, layers=count)


def test_stage_split_gives_the_ends_one_layer_fewer():
    assert stage_layers(_layers(126), 16) == [7] + [8] * 14 + [7]  # Llama 3 §3.3.2
    assert stage_layers(_layers(128), 16) == [8] * 16  # the two left over fill the first and last
    assert stage_layers(_layers(32), 4) == [8] * 4
    assert stage_layers(_layers(96), 16) == [6] * 16
    assert stage_layers(_layers(30), 4) == [7, 8, 8, 7]
    assert stage_layers(_layers(5), 4) == [1, 2, 1, 1]  # one fewer would empty the ends: even
    assert stage_layers(_layers(126), 16, 8) == [0] + [1] * 126 + [
        0
    ]  # the planner's extension: embedding and output alone
    for layers in range(1, 33):
        for stages in range(1, layers + 1):
            split = stage_layers(_layers(layers), stages)
            assert sum(split) == layers and min(split) >= 1 and max(split) - min(split) <= 2


def test_nanotrons_split_balances_the_layers_and_the_output_layer_by_their_cost():
    """nanotron's 1.34B (16 layers of 4·2048² + 3·8192·2048 = 67.1 M, the output layer
    131,072·2,048 = 268.4 M, 4 layers' worth) on 2 ranks: the first takes layers until its running
    cost passes half of 1,342 M, the eleventh (738 M), the second the last 5 and the output layer
    (604 M); by layers it would be 8 and 8 (805 M on the second). The 8.86B on 4 ranks: 9, 9, 8, 6.
    On 8 ranks the 1.34B's output layer would land on the seventh rank, which the planner's stages
    do not describe: by layers then. Interleaved stages are split by layers."""
    small = ModelConfig(
        layers=16, dim=2048, ffn=8192, heads=32, kv_heads=32, vocab=131072, mlp="swiglu"
    )
    assert cost_split(small, 2) == [11, 5]
    assert stage_layers(small, 2, split="cost") == [11, 5]
    assert stage_layers(small, 2) == [8, 8]
    larger = dataclasses.replace(small, layers=32, dim=4096, ffn=14336)
    assert cost_split(larger, 4) == [9, 9, 8, 6]
    assert cost_split(small, 8) is None
    assert stage_layers(small, 8, split="cost") == stage_layers(small, 8) == [2] * 8
    assert stage_layers(larger, 2, 2, split="cost") == stage_layers(larger, 2, 2)
    # the planner's nanotron stack plans the slowest rank of the cost split
    par = Parallelism(layout=Layout(pp=2, dp=4), schedule="1f1b", microbatches=8)
    nanotron = Job(small, load_cluster("dgx-h100"), par, 4096, 32, stack="nanotron")
    assert nanotron.stage_layers == [11, 5]
    assert max_rank_params(small, 2, 1, 1, "cost") == 11 * small.layer_params() + small.vocab * 2048


def test_stage_time_is_the_sum_of_its_layers_and_ends():
    j = job(L405, H100, Layout(8, 1, 16, 64), 8192, 2048, "1f1b", 32)
    one, eight = stage_time(j.work, 1), stage_time(j.work, 8)
    assert eight.forward == pytest.approx(8 * one.forward)
    chunks = chunk_times(j)
    assert chunks[1] == eight
    assert (
        chunks[0].forward > 7 * one.forward
        and chunks[-1].forward > 7 * one.forward + chunks[0].forward - 7 * one.forward
    )
    full = stage_time(
        dataclasses.replace(j, par=dataclasses.replace(j.par, recompute="full")).work, 1
    )
    assert full.input_grad_s == pytest.approx(one.input_grad_s + one.forward_s)


def _with_gemm(tmp_path, path, one_worker):
    text = path.read_text().replace(
        "[node]", f"[[gpu.gemm]]\nm = 512\nn = 512\nk = 512\ntflops = {one_worker}\n[node]"
    )
    out = tmp_path / "measured.toml"
    out.write_text(text)
    return out


def _cpu_profile(tmp_path, extra: str = ""):
    """A 2-core CPU profile of 8 workers (and `extra` TOML)."""
    path = tmp_path / "cpu.toml"
    path.write_text(
        """
dtype = "fp32"
[gpu]
name = "2-core CPU"
peak_tflops = 0.05
memory_gb = 16.0
hbm_bw_gbps = 10.0
[node]
gpus = 8
intra_bw_gbps = 1.0
concurrent_ranks = 2
[network]
nic_bw_gbps = 1.0
"""
        + extra
    )
    return path


def test_ranks_sharing_cpu_cores_compute_slower(tmp_path):
    path = _cpu_profile(tmp_path)
    cpu = load_cluster(str(path))
    m = get_preset("debug")

    def stage(cluster, dp):
        return stage_time(job(m, cluster, Layout(dp=dp), 256, dp, "1f1b", 1).work, 4)

    one, two, four = stage(cpu, 1), stage(cpu, 2), stage(cpu, 4)
    assert four.forward_s == pytest.approx(2 * two.forward_s)
    assert two.forward_s == pytest.approx(
        one.forward_s
    )  # no one-worker figure: two cores, twice the work
    measured = load_cluster(
        str(_with_gemm(tmp_path, path, one_worker=0.03))
    )  # two together 0.05, alone 0.03
    alone, pair = stage(measured, 1), stage(measured, 2)
    assert pair.forward_s == pytest.approx(alone.forward_s * 2 * 0.03 / 0.05)


def test_on_a_cpu_profile_collectives_bubbles_and_reductions_follow_the_cores(tmp_path):
    path = _cpu_profile(
        tmp_path,
        """[[collectives]]
op = "all_reduce"
nproc = 2
alpha_s = 0.001
beta_s_per_byte = 1e-9
[[collectives]]
op = "reduce_scatter"
nproc = 4
alpha_s = 0.004
beta_s_per_byte = 2e-9
""",
    )
    cpu = load_cluster(str(path))
    # measured with 2 (or 4) ranks busy: 4 ranks on 2 cores take turns, 8 take turns twice as long
    assert collective_time("all_reduce", 1e6, Group(2, 1, 4), cpu) == pytest.approx(2 * 0.002)
    assert collective_time("all_reduce", 1e6, Group(2, 1, 8), cpu) == pytest.approx(4 * 0.002)
    assert collective_time("reduce_scatter", 1e6, Group(4, 1, 8), cpu) == pytest.approx(2 * 0.006)
    # half a pipeline's ranks work through its bubble, on the cores the waiting half leave
    # (fill and drain through the faster rank: fill_and_drain_saving)
    from fourd.plan.perf import fill_and_drain_saving

    small = get_preset("small")
    jobs = [job(small, cpu, Layout(pp=2, dp=dp), 256, 16, "gpipe", 4, 1, 2) for dp in (1, 2)]
    alone, shared = (step_time(j) for j in jobs)
    bubble = bubble_time("gpipe", 2, 4, 1, shared.per_microbatch) - fill_and_drain_saving(jobs[1])
    assert alone.bubble_s == pytest.approx(
        bubble_time("gpipe", 2, 4, 1, alone.per_microbatch) - fill_and_drain_saving(jobs[0])
    )
    assert shared.bubble_s == pytest.approx(bubble / 2)
    # fourd's FSDP reduce-scatters once a step, after the last microbatch, at any ZeRO 2 microbatch count
    one, four = (
        step_time(job(small, cpu, Layout(dp=4), 256, 16, "1f1b", m, 1, 2)).dp_total_s
        for m in (1, 4)
    )
    assert four == pytest.approx(one) and one > 0


def test_search_finds_at_least_41_percent_for_405b_on_16k():
    plans = request.plans(request.resolve(L405, H100, {"gpus": 16384, "seq": 8192}))
    best = plans[0]
    assert best.fits and best.mfu >= 0.41
    # those that fit with the allocator's cache first, then those that fit only by emptying it
    fitting = [(p.room, -p.tokens_per_s) for p in plans if p.fits]
    assert fitting == sorted(fitting)
    assert best.config.layout.world == 16384


def test_step_time_adds_up():
    j = job(L405, H100, Layout(8, 1, 16, 64), 8192, 2048, "1f1b", 32, 1, 1, "selective")
    s = step_time(j)
    assert s.step_s == pytest.approx(
        s.compute_s + s.bubble_s + s.p2p_s + s.dp_exposed_s + s.overlap_s + s.optimizer_s
    )
    # 15 of the slowest rank's microbatches, less what fill and drain save through the 15 ranks
    # without the output layer (fourd.plan.perf.fill_and_drain_saving)
    from fourd.plan.perf import fill_and_drain_saving, rank_busy

    busy = rank_busy(j.work, 16, 1)
    saving = sum(max(busy) - b for b in busy)
    assert saving > 0 and fill_and_drain_saving(j) == pytest.approx(saving)
    slowest = s.per_microbatch.forward + s.per_microbatch.backward
    assert s.bubble_s == pytest.approx(15 * slowest - saving)
    z3 = step_time(dataclasses.replace(j, par=dataclasses.replace(j.par, zero=3)))
    assert z3.dp_total_s > 30 * s.dp_total_s  # stage 3 gathers weights for every microbatch


def test_fp32_profile_doubles_weight_bytes():
    plan = _table4(*TABLE4[0][:2])
    plan32 = evaluate(dataclasses.replace(plan.job, precision="fp32"))
    assert plan32.memory.params == 2 * plan.memory.params


def test_without_sequence_parallelism_tp_all_reduces_and_norms_run_on_every_token():
    from fourd.plan.block import traffic
    from fourd.plan.perf import layer_comm

    g = placement(Layout(tp=8))
    plain = job(L405, H100, Layout(tp=8), 8192, 1, "1f1b", 1, sp=False)
    f, b, _, _ = layer_comm(plain.work)
    act = 8192 * L405.dim * 2
    assert f == b == pytest.approx(2 * collective_time("all_reduce", act, g["tp"], H100))
    sp = job(L405, H100, Layout(tp=8), 8192, 1, "1f1b", 1)
    sp_f, sp_b, _, _ = layer_comm(sp.work)
    assert sp_f == pytest.approx(
        2
        * (
            collective_time("all_gather", act, g["tp"], H100)
            + collective_time("reduce_scatter", act, g["tp"], H100)
        )
    )
    assert sp_b > sp_f  # the weight gradients gather the saved input shards again
    # what a layer keeps of the residual stream's size: both norms' FP32 inputs and results and the BF16 inputs
    # of the five linear layers that autocast casts apart (fourd's eager block, one data-parallel rank)
    gap = traffic(plain.work).saved - traffic(sp.work).saved
    assert gap == pytest.approx((4 * 4 + 5 * 2) * L405.dim * (1 - 1 / 8))


def test_zero_shards_over_dp_and_cp():
    plan = evaluate(
        job(L405, H100, Layout(8, 16, 16, 8), 131072, 128, "interleaved", 16, 8, 1, "selective")
    )
    per_gpu = plan.memory.params / 2  # BF16 weights
    assert plan.memory.optimizer == pytest.approx(per_gpu * 12 / 128)


def test_measured_gemms_and_collectives_replace_the_models(tmp_path):
    path = tmp_path / "measured.toml"
    path.write_text("""
[gpu]
name = "x"
peak_tflops = 1.0
memory_gb = 16.0
hbm_bw_gbps = 10.0
[[gpu.gemm]]
m = 256
n = 256
k = 256
tflops = 0.02
[[gpu.gemm]]
m = 1024
n = 1024
k = 1024
tflops = 0.06
[node]
gpus = 8
intra_bw_gbps = 1.0
[network]
nic_bw_gbps = 1.0
[[collectives]]
op = "all_reduce"
nproc = 2
alpha_s = 1e-4
beta_s_per_byte = 2e-9
""")
    c = load_cluster(str(path))
    assert gemm_time(1024, 1024, 1024, c) == pytest.approx(2 * 1024**3 / 0.06e12)
    assert gemm_time(4096, 4096, 4096, c) == pytest.approx(
        2 * 4096**3 / 0.06e12
    )  # flat beyond the samples
    assert gemm_time(512, 512, 512, c) == pytest.approx(
        2 * 512**3 / 0.04e12
    )  # halfway in log(FLOPs)
    assert collective_time("all_reduce", 1e6, Group(2, 1, 2), c) == pytest.approx(1e-4 + 2e-3)
    # no fit for 4 ranks: the ring model on the node's 1 GB/s, a tree's 2·log2(4) steps of 5 us
    assert collective_time("all_reduce", 1e6, Group(4, 1, 4), c) == pytest.approx(
        4 * 5e-6 + 1.5e6 / 1e9
    )


def test_training_shape_gemms_attention_and_eager_rates_replace_the_models(tmp_path):
    from fourd.plan.block import traffic
    from fourd.plan.kernels import attention_time, elementwise_time, optimizer_time
    from fourd.plan.perf import layer_time

    path = tmp_path / "cpu.toml"
    path.write_text("""
dtype = "fp32"
[gpu]
name = "x"
peak_tflops = 1.0
memory_gb = 16.0
hbm_bw_gbps = 10.0
elementwise_gbps = 5.0
optimizer_gbps = 2.0
[[gpu.gemm_shapes]]
m = 4096
n = 256
k = 256
tflops = 0.1
[[gpu.gemm_shapes]]
m = 4096
n = 256
k = 256
tflops = 0.08
[[gpu.gemm_shapes]]
m = 256
n = 256
k = 4096
tflops = 0.05
[[gpu.attention]]
seq = 256
head_dim = 32
fwd_tflops = 0.02
bwd_tflops = 0.01
masked_fwd_tflops = 0.04
masked_bwd_tflops = 0.03
[node]
gpus = 8
intra_bw_gbps = 1.0
[network]
nic_bw_gbps = 1.0
""")
    c = load_cluster(str(path))
    flops = 2 * 4096 * 256 * 256
    assert gemm_time(4096, 256, 256, c) == pytest.approx(
        flops / 0.09e12
    )  # two orientations measured there
    assert gemm_time(256, 256, 4096, c) == pytest.approx(flops / 0.05e12)
    assert gemm_time(256, 256, 16384, c) == pytest.approx(
        4 * flops / 0.05e12
    )  # flat beyond the samples
    # equally far (in log2) from both points: the mean of the three samples
    assert gemm_time(1024, 256, 1024, c) == pytest.approx(flops / (0.23e12 / 3))
    pairs = 4096 * 256 / 2
    fwd, bwd = attention_time(4096, 256, 8, 32, c)
    assert fwd == pytest.approx(4 * pairs * 32 * 8 / 0.02e12)
    assert bwd == pytest.approx(2.5 * 4 * pairs * 32 * 8 / 0.01e12)
    # an explicit mask (context parallelism's chunks) computes every pair, at the masked kernel's rate
    assert attention_time(4096, 256, 8, 32, c, causal=False) == pytest.approx(
        (8 * pairs * 32 * 8 / 0.04e12, 2.5 * 8 * pairs * 32 * 8 / 0.03e12)
    )
    assert elementwise_time(1e9, c) == pytest.approx(0.2)
    assert optimizer_time(1e6, c, 4) == pytest.approx(32e6 / 2e9)
    m = get_preset("small")
    work = job(m, c, Layout(), 256, 16, "1f1b", 1, sp=False).work
    t = layer_time(work)
    # wq, wk, wv, wo, w1, w3, w2 of the small preset (dim 256, 8 heads and 4 KV heads of 32, FFN 704)
    shapes = [(256, 256), (128, 256), (128, 256), (256, 256), (704, 256), (704, 256), (256, 704)]
    gemms = sum(gemm_time(4096, n, k, c, 4) for n, k in shapes)
    assert t.forward_s == pytest.approx(gemms + fwd + 4096 * traffic(work).forward / 5e9)


def test_cpu_profiles_hide_no_data_parallel_traffic_behind_compute(tmp_path):
    path = tmp_path / "cpu.toml"
    text = """
dtype = "fp32"
[gpu]
name = "x"
peak_tflops = 0.05
memory_gb = 16.0
hbm_bw_gbps = 10.0
[node]
gpus = 8
intra_bw_gbps = 1.0
{cores}
[network]
nic_bw_gbps = 1.0
"""
    path.write_text(text.format(cores="concurrent_ranks = 2"))
    cpu = load_cluster(str(path))
    s = step_time(job(get_preset("small"), cpu, Layout(dp=2), 256, 16, "1f1b", 1, 1, 2))
    assert s.dp_exposed_s == s.dp_total_s > 0 and s.overlap_s == 0
    path.write_text(text.format(cores=""))
    gpu_like = step_time(
        job(get_preset("small"), load_cluster(str(path)), Layout(dp=2), 256, 16, "1f1b", 1, 1, 2)
    )
    assert gpu_like.dp_exposed_s < gpu_like.dp_total_s
