"""The step simulator (fourd.sim.step) on steps small enough to time by hand, in one process (fast):

- two pipeline ranks on two servers, one NIC each of 1,024 B/s: an activation of 1,024 B takes 1 s,
  a gradient bucket of 4 B per parameter shares its NIC with the gradient sent back;
- which collectives each ZeRO stage runs, and their names; the links between neighbours;
- a straggler: its optimizer step is slowed too; one replica class or two;
- the refusals at their edges: the pieces a step may run, the pipeline communication, the slow GPU;
- the idle shares of a trace that does not start at 0.
"""

from __future__ import annotations

import dataclasses

import pytest

from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism
from fourd.model.config import ModelConfig
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.kernels import optimizer_time
from fourd.plan.stack import load_stack
from fourd.schedules import Action, Schedule, build_schedule
from fourd.sim import step
from fourd.sim.step import Event, build_comm, idle_fractions, simulate, simulate_step, timeline

UNIT = {"F": 1, "B": 2, "I": 1, "W": 1}
# 2 layers of 464 parameters (q 64, k and v 128, o 64, w1 w2 w3 3 · 64, norms 16), an embedding of
# 64: stage 0 holds 528, stage 1 536 (the output and the final norm's 8)
TINY = ModelConfig(layers=2, dim=8, ffn=8, heads=1, kv_heads=1, vocab=8)


def _cluster(tmp_path, gpus_per_node=1, nic_bps=1024.0, nvlink_bps=4096.0, latency_us=0.0, eff=1.0):
    path = tmp_path / f"c{gpus_per_node}-{eff}.toml"
    path.write_text(f"""name = "tiny"
[gpu]
name = "x"
peak_tflops = 1.0
memory_gb = 80.0
hbm_bw_gbps = 1.0
[node]
gpus = {gpus_per_node}
intra_bw_gbps = {nvlink_bps / 1e9!r}
intra_latency_us = {latency_us}
intra_efficiency = {eff}
[network]
nic_bw_gbps = {nic_bps / 1e9!r}
latency_us = {latency_us}
nic_efficiency = {eff}
""")
    return load_cluster(str(path))


def _job(cluster, layout=None, stack="fourd", **par):
    """TINY, one 64-token sequence per microbatch and replica: an activation is 64 · 8 · 2 B."""
    layout = layout or Layout(pp=2, dp=2)
    par = Parallelism(layout=layout, **{"microbatches": 1, "zero": 0, **par})
    return Job(TINY, cluster, par, 64, layout.dp * par.microbatches, stack=stack)


def test_two_ranks_over_nics_by_hand(tmp_path):
    """GPipe, one microbatch, DDP over dp = 2 (the other replica is represented): F0 [0, 1], its
    activation over the NIC [1, 2], F1 [2, 3], B1 [3, 5]; then stage 1's 2,144 B all-reduce and the
    1,024 B gradient to rank 0 share rank 1's NIC, 512 B/s each: the gradient lands at 7, the
    all-reduce has 1,120 B left at 1,024 B/s, 8.09375. B0 [7, 9], its 2,112 B all-reduce alone,
    11.0625, then its 0.5 s optimizer step: 11.5625."""
    comm = build_comm(_job(_cluster(tmp_path)))
    r = simulate(build_schedule("gpipe", 2, 1), [UNIT] * 2, comm=comm, optimizer_s=[0.5, 0.25])
    assert [[(e.kind, e.start, e.end) for e in rank] for rank in r.events] == [
        [("F", 0, 1), ("B", 7, 9)],
        [("F", 2, 3), ("B", 3, 5)],
    ]
    assert [(t.kind, t.rank, t.name, t.start, t.end) for t in r.transfers] == [
        ("pp", 0, "act 0.0 to rank 1", 1, 2),
        ("pp", 1, "grad 1.0 to rank 0", 5, 7),
        ("ar", 1, "all_reduce stage 1 layer 0", 5, 8.09375),
        ("ar", 0, "all_reduce stage 0 layer 0", 9, 11.0625),
    ]
    assert r.step_time_s == 11.5625
    assert (r.busy_s, r.optimizer_s, r.pipeline_span_s) == ([3, 3], [0.5, 0.25], 9)
    assert r.per_rank_idle_fraction == [1 - 3.5 / 11.5625, 1 - 3.25 / 11.5625]
    assert r.bubble_fraction == 1 - 3 / 9


def test_the_links_of_a_job(tmp_path):
    """Neighbours on one server talk over NVLink, on two over NICs, each with its latency; a DP ring
    with k members per server sends 1/k of its bytes through each NIC and all over NVLink."""
    cluster = _cluster(tmp_path, gpus_per_node=4, latency_us=2.0)
    comm = build_comm(_job(cluster, Layout(tp=2, pp=2, dp=4)))  # pp ranks 0 and 2, dp stride 4
    assert comm.capacity == {
        "nic_out": 1024.0,
        "nic_in": 1024.0,
        "nvl_out": 4096.0,
        "nvl_in": 4096.0,
    }
    nvlink = (("nvl_out", "nvl_in"), 4096.0, 2e-6)
    assert comm.p2p == {(0, 0): nvlink, (0, 1): nvlink, (1, 0): nvlink, (1, 1): nvlink}
    assert comm.p2p_bytes == 64 * 8 * 2  # without sequence parallelism every TP rank sends all
    # the dp group, ranks 0, 4, 8, 12: one member per server
    assert comm.dp_links == (("nic_out", 1.0), ("nic_in", 1.0))
    assert comm.dp_params == [528 / 2, 536 / 2]
    # pp ranks 0 and 16 on 8-GPU servers (tp = 4, cp = 4): two servers, the NICs; links that reach
    # half their rate
    cluster = _cluster(tmp_path, gpus_per_node=8, latency_us=3.0, eff=0.5)
    comm = build_comm(_job(cluster, Layout(tp=4, cp=4, pp=2), sequence_parallel=True))
    assert comm.p2p[(0, 1)] == (("nic_out", "nic_in"), 512.0, 3e-6)
    assert comm.p2p[(1, 1)] == (("nvl_out", "nvl_in"), 2048.0, 3e-6)
    assert comm.capacity == {"nic_out": 512.0, "nic_in": 512.0, "nvl_out": 2048.0, "nvl_in": 2048.0}
    assert comm.p2p_bytes == 64 / 4 * 8 * 2 / 4  # a CP rank's tokens, its SP shard
    # dp = 4 with tp = 2 on 4-GPU servers: ranks 0, 2 on one server, 4, 6 on the next
    comm = build_comm(_job(cluster, Layout(tp=2, dp=4)))
    assert comm.dp_links == (("nvl_out", 1.0), ("nvl_in", 1.0))  # all 4 on one 8-GPU server
    comm = build_comm(_job(_cluster(tmp_path, gpus_per_node=4), Layout(tp=2, dp=4)))
    assert comm.dp_links == (
        ("nic_out", 0.5),
        ("nic_in", 0.5),
        ("nvl_out", 1.0),
        ("nvl_in", 1.0),
    )


def _collectives(tmp_path, zero, microbatches=2, stack="nemo"):
    """nemo: Megatron's --overlap-param-gather, ZeRO 1's weights gathered beside the forward."""
    comm = build_comm(_job(_cluster(tmp_path), zero=zero, microbatches=microbatches, stack=stack))
    sched = build_schedule("1f1b", 2, microbatches)
    r = simulate(sched, [UNIT] * 2, layers=[2, 2], comm=comm)
    return r, [(t.kind, t.rank, t.name) for t in r.transfers if t.kind != "pp"]


def test_which_collectives_each_zero_stage_runs(tmp_path):
    """Two layers a stage, two microbatches. DDP all-reduces each layer once, after the stage's
    last backward; ZeRO-1 gathers each stage's layers once before its first forward and
    reduce-scatters once; ZeRO-2 reduce-scatters every microbatch; ZeRO-3 gathers before every
    forward and backward too."""

    def names(kind, op, rank, times):
        return sorted([(kind, rank, f"{op} stage {rank} layer {i}") for i in (0, 1)] * times)

    _, ddp = _collectives(tmp_path, 0)
    assert sorted(ddp) == names("ar", "all_reduce", 0, 1) + names("ar", "all_reduce", 1, 1)
    for zero, gathers, scatters in ((1, 1, 1), (2, 1, 2), (3, 4, 2)):
        _, found = _collectives(tmp_path, zero)
        for rank in (0, 1):
            mine = [t for t in found if t[1] == rank]
            assert sorted(t for t in mine if t[0] == "ag") == names(
                "ag", "all_gather", rank, gathers
            ), (zero, rank)
            assert sorted(t for t in mine if t[0] == "rs") == names(
                "rs", "reduce_scatter", rank, scatters
            ), (zero, rank)


def test_a_zero1_forward_waits_for_its_weights_and_its_event_spans_its_pieces(tmp_path):
    """ZeRO-1 gathers stage 0's two layers from time 0, one after the other: 528 · 2 B / 2 each,
    of which a ring of 2 moves half, 264 B at 1,024 B/s. F0.0's first half starts when the first
    arrives, 0.2578125; its second, at 0.7578125, finds the second there (0.515625); the event runs
    from the first piece's start to the last's end."""
    r, _ = _collectives(tmp_path, 1)
    first = r.events[0][0]
    assert (first.kind, first.microbatch) == ("F", 0)
    assert (first.start, first.end) == (0.2578125, 1.2578125)
    # fourd's ShardedAdamW gathers inside the optimizer's step: the forward has its weights at 0
    r, _ = _collectives(tmp_path, 1, stack="fourd")
    assert (r.events[0][0].start, r.events[0][0].end) == (0, 1)


def test_a_bucket_of_a_third_of_a_stage_is_not_rounded(tmp_path):
    """ZeRO-2 on one pipeline rank of 1,064 parameters in 3 buckets: each reduce-scatters 4 ·
    1,000 / 3 B of the 1,000 besides the input embedding's 64, and the last, when the backward
    computes the embedding's gradient, 4 · 64 B more; half of it over the ring of 2, alone on the
    NIC."""
    comm = build_comm(_job(_cluster(tmp_path), Layout(dp=2), zero=2))
    assert comm.embedding_params == 64
    r = simulate(build_schedule("1f1b", 1, 1), [UNIT], layers=[3], comm=comm)
    scatters = [t.end - t.start for t in r.transfers if t.kind == "rs"]
    layer = 4 * 1000 / 3
    assert scatters == pytest.approx(
        [layer / 2 / 1024, layer / 2 / 1024, (layer + 4 * 64) / 2 / 1024], rel=1e-12
    )


def test_ddp_reduces_after_the_last_backward_of_a_long_list(tmp_path):
    """200 microbatches on one rank: the last backward is its 400th action (CPython keeps one
    object per int only up to 256)."""
    comm = build_comm(_job(_cluster(tmp_path), Layout(dp=2), microbatches=200))
    r = simulate(build_schedule("1f1b", 1, 200), [UNIT], comm=comm)
    reduces = [t for t in r.transfers if t.kind == "ar"]
    assert [(t.name, t.start) for t in reduces] == [("all_reduce stage 0 layer 0", 600)]


@pytest.mark.parametrize("zero, op", [(1, "reduce_scatter"), (0, "all_reduce")])
def test_a_ddp_stack_reduces_its_gradients_in_buckets_as_the_backward_fills_them(
    tmp_path, monkeypatch, zero, op
):
    """A stack with DDP buckets of 0.0005 MiB of BF16 gradients, 1,048.576 B of FP32 ones: one
    rank's 1,064 parameters, 4,256 B of gradients, from two layer pieces of 2,000 B and the input
    embedding's 256 B with the last, fill one bucket when the first piece ends and three more and
    the 61.696 B left when the last does; each its own collective over the ring of 2 (a
    reduce-scatter moves half its bytes, an all-reduce all of them) at the NIC's 1,024 B/s."""
    monkeypatch.setenv("FOURD_HOME", str(tmp_path))
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "ddp.toml").write_text("dp_bucket_mb = 0.0005\n")
    load_stack.cache_clear()
    try:
        comm = build_comm(_job(_cluster(tmp_path), Layout(dp=2), stack="ddp", zero=zero))
        r = simulate(build_schedule("1f1b", 1, 1), [UNIT], layers=[2], comm=comm)
    finally:
        load_stack.cache_clear()
    assert comm.bucket_bytes == pytest.approx(1048.576, rel=1e-12)
    share = 0.5 if zero else 1.0
    reductions = [t for t in r.transfers if t.kind == ("rs" if zero else "ar")]
    assert [t.name for t in reductions] == [f"{op} bucket {n} of pipeline rank 0" for n in range(5)]
    sizes = [1048.576] * 4 + [4256 - 4 * 1048.576]
    assert [t.end - t.start for t in reductions] == pytest.approx(
        [share * size / 1024 for size in sizes], rel=1e-9
    )
    # the first starts when the backward's first piece (half of it) ends, the second when the
    # backward ends and the first is done, the rest queue behind
    backward = r.events[0][1]
    assert backward.kind == "B"
    assert reductions[0].start == pytest.approx((backward.start + backward.end) / 2, rel=1e-12)
    second = max(reductions[0].end, backward.end)
    assert reductions[1].start == pytest.approx(second, rel=1e-12)
    for before, after in zip(reductions[1:], reductions[2:]):
        assert after.start == pytest.approx(before.end, rel=1e-12)


def test_a_zero2_optimizer_step_waits_for_every_microbatchs_gradients(tmp_path):
    """ZeRO-2: each microbatch's gradients are reduce-scattered apart; the optimizer step starts
    after the last of them."""
    r, _ = _collectives(tmp_path, 2)
    last_scatter = max(t.end for t in r.transfers if t.kind == "rs" and t.rank == 0)
    comm = build_comm(_job(_cluster(tmp_path), zero=2, microbatches=2, stack="nemo"))
    timed = simulate(
        build_schedule("1f1b", 2, 2), [UNIT] * 2, layers=[2, 2], comm=comm, optimizer_s=[1, 0]
    )
    assert timed.step_time_s == pytest.approx(last_scatter + 1, rel=1e-12)


def test_neighbours_of_three_ranks_are_named_by_the_rank_they_reach(tmp_path):
    cluster = _cluster(tmp_path)
    comm = build_comm(_job(cluster, Layout(pp=3)))
    r = simulate(build_schedule("gpipe", 3, 1), [UNIT] * 3, comm=comm)
    assert [t.name for t in r.transfers] == [
        "act 0.0 to rank 1",
        "act 1.0 to rank 2",
        "grad 2.0 to rank 1",
        "grad 1.0 to rank 0",
    ]
    # a link's bytes cross its two ends once: 1 s an activation
    assert [t.end - t.start for t in r.transfers] == [1, 1, 1, 1]


def test_transfers_in_opposite_directions_share_no_link(tmp_path):
    """Interleaved, two ranks of two stages: each rank sends activations and gradients to the
    other while the other sends to it (12 to 13 s); a NIC's out and in links are apart, so each
    transfer takes its 1 s alone."""
    comm = build_comm(_job(_cluster(tmp_path), Layout(pp=2)))
    r = simulate(build_schedule("interleaved", 2, 2, 2), [UNIT] * 4, comm=comm)
    assert [t.end - t.start for t in r.transfers] == [1] * 12
    assert r.step_time_s == 21


def test_a_stragglers_optimizer_step_is_slowed_too():
    sched = build_schedule("gpipe", 1, 1)
    # one replica: it is the straggler's, and stands for itself
    alone = simulate(sched, [UNIT], optimizer_s=[5], slow=(0, 2), dp=1)
    assert (alone.step_time_s, alone.optimizer_s, alone.slow_events) == (16, [10], None)
    assert [(e.start, e.end) for e in alone.events[0]] == [(0, 2), (2, 6)]
    # two replicas: the healthy one stands for the others and keeps its pace
    two = simulate(sched, [UNIT], optimizer_s=[5], slow=(0, 2), dp=2)
    assert (two.step_time_s, two.optimizer_s) == (16, [5])
    assert two.events == timeline(sched, UNIT)
    assert [(e.start, e.end) for e in two.slow_events[0]] == [(0, 2), (2, 6)]


def test_the_pieces_a_step_may_run():
    step._check_size(200_000)
    with pytest.raises(FourdError) as refused:
        step._check_size(200_001)
    assert str(refused.value) == (
        "this step has 200,001 compute pieces to simulate, more than 200,000: use fewer "
        "microbatches, virtual stages or pipeline ranks"
    )
    # F and B of 50,001 layer pieces, for the healthy replicas and the straggler's
    with pytest.raises(FourdError, match="200,004 compute pieces"):
        simulate(build_schedule("gpipe", 1, 1), [UNIT], layers=[50_001], slow=(0, 2.0), dp=2)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_a_step_is_sized_before_its_schedule_is_built(tmp_path, schedule):
    """33,334 microbatches of two layers: 133,336 F and B pieces fit (the next check, a slow GPU
    outside the layout, refuses it), 200,004 F, I and W do not."""
    par = Parallelism(layout=Layout(), schedule=schedule, microbatches=33_334)
    job = Job(TINY, _cluster(tmp_path), par, 64, 33_334)
    refusal = {"1f1b": "slow GPU 9:2.0", "zero-bubble": "200,004 compute pieces"}[schedule]
    with pytest.raises(FourdError, match=refusal):
        simulate_step(job, slow_gpu=(9, 2.0))


def test_the_pipeline_and_the_data_parallel_traffic_it_simulates(tmp_path):
    cluster = _cluster(tmp_path)
    for other in ("synchronous", "blocking"):
        with pytest.raises(
            FourdError, match=f"overlapped pipeline communication only, not {other}"
        ):
            simulate_step(dataclasses.replace(_job(cluster), pipeline_comm=other))
    # one pipeline rank sends nothing between stages: any pipeline communication is the same
    one = dataclasses.replace(_job(cluster, Layout(dp=2)), pipeline_comm="synchronous")
    assert simulate_step(one).step_time_s > 0
    late = dataclasses.replace(_job(cluster, Layout(dp=2)), dp_overlap=False)
    with pytest.raises(FourdError, match="reduces after the backward"):
        simulate_step(late)


@pytest.mark.parametrize("gpu,factor", [(-1, 2.0), (4, 2.0), (0, 0.0), (0, float("inf"))])
def test_a_slow_gpu_is_a_rank_of_the_layout_and_a_finite_positive_factor(tmp_path, gpu, factor):
    job = _job(_cluster(tmp_path))
    with pytest.raises(FourdError) as refused:
        simulate_step(job, slow_gpu=(gpu, factor))
    assert str(refused.value) == (
        f"slow GPU {gpu}:{factor}: give a rank in 0..3 of layout tp=1,cp=1,pp=2,dp=2 and a "
        "factor > 0"
    )
    assert simulate_step(job, slow_gpu=(3, 1.5)).slow_events is not None


def test_the_optimizer_steps_over_the_shards_unrounded(tmp_path):
    """ZeRO-1 over dp = 3: each rank updates a third of its stage's 528 or 536 parameters."""
    cluster = _cluster(tmp_path)
    job = _job(cluster, Layout(pp=2, dp=3), zero=1)
    assert simulate_step(job, comm=False).optimizer_s == [
        optimizer_time(528 / 3, cluster, 2),
        optimizer_time(536 / 3, cluster, 2),
    ]
    # ZeRO 0: every replica updates all of its stage
    unsharded = _job(cluster, Layout(pp=2, dp=3), zero=0)
    assert simulate_step(unsharded, comm=False).optimizer_s == [
        optimizer_time(528, cluster, 2),
        optimizer_time(536, cluster, 2),
    ]


def test_zero_bubble_idles_p_minus_1_units_on_each_rank():
    """ZB-H1 with F = I = W = 1: 3m + p − 1 units, each rank idle p − 1 (Qi et al. 2023)."""
    for p, m in ((2, 2), (3, 4), (4, 5)):
        r = simulate(build_schedule("zero-bubble", p, m), [UNIT] * p)
        assert r.step_time_s == 3 * m + p - 1
        assert [r.step_time_s - busy for busy in r.busy_s] == [p - 1] * p


def test_a_step_of_no_time_has_no_bubble():
    r = simulate(build_schedule("1f1b", 2, 2), [{"F": 0, "B": 0}] * 2)
    assert (r.step_time_s, r.pipeline_span_s, r.bubble_fraction) == (0, 0, 0.0)


def test_a_stalled_step_names_the_first_gpu_left_waiting():
    """Rank 0 runs its backward before the forward it needs: both ranks wait for ever."""
    f0, b0, f1, b1 = Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)
    stuck = Schedule(
        name="stuck", pp=2, microbatches=1, virtual_stages=1, ranks=((b0, f0), (f1, b1))
    )
    with pytest.raises(RuntimeError, match=r"^simulation stalled at \(0, 0\): .*kind='B', stage=0"):
        simulate(stuck, [UNIT] * 2)
    # rank 0 runs F0 and waits at B0 for a gradient; rank 1 waits at its first action, B1: the line
    # names the piece rank 0 is at, not the one at rank 1's position
    later = dataclasses.replace(stuck, ranks=((f0, b0), (b1, f1)))
    with pytest.raises(RuntimeError, match=r"^simulation stalled at \(0, 0\): .*kind='B', stage=0"):
        simulate(later, [UNIT] * 2)


def test_idle_shares_of_a_trace_that_starts_late():
    def event(rank, start, end):
        return Event(rank=rank, stage=rank, kind="F", microbatch=0, start=start, end=end)

    step_s, idle = idle_fractions([[event(0, 10, 14)], [event(1, 12, 20)]])
    assert (step_s, idle) == (10, [0.6, 0.2])


def test_a_comm_is_named_by_keywords(tmp_path):
    comm = build_comm(_job(_cluster(tmp_path)))
    with pytest.raises(TypeError):
        step.Comm(*dataclasses.astuple(comm))  # type: ignore[misc]


def test_a_stack_that_gathers_in_the_step_gathers_each_ranks_own_stage_after_its_update(tmp_path):
    """fourd's ZeRO 1 (ShardedAdamW broadcasts after the update): each rank gathers its own stage's two
    layers once, starting when its update ends (no optimizer time given: the update takes 0, so when
    its last reduce-scatter ends). Rank 0, the last to finish, has its NIC to itself: stage 0's
    528 · 2 B / 2 a layer, of which a ring of 2 moves half, 264 B at 1,024 B/s, one layer after the
    other. The step ends when the last weights arrive."""
    r, _ = _collectives(tmp_path, 1, stack="fourd")
    gathers = {}
    for rank in (0, 1):
        mine = [t for t in r.transfers if t.kind == "ag" and t.rank == rank]
        gathers[rank] = sorted(mine, key=lambda t: t.start)
        names = [t.name for t in gathers[rank]]
        assert names == [f"all_gather stage {rank} layer {i}" for i in (0, 1)]
        reduced = max(t.end for t in r.transfers if t.kind == "rs" and t.rank == rank)
        assert gathers[rank][0].start == reduced
    first, second = gathers[0]
    assert (first.end - first.start, second.start) == (264 / 1024, first.end)
    assert second.end - second.start == 264 / 1024
    assert r.step_time_s == max(t.end for t in r.transfers if t.kind == "ag")


def test_a_gradient_bucket_is_keyed_per_microbatch_only_where_each_microbatch_reduces():
    """DDP all-reduces and ZeRO 1 reduce-scatters once a step (microbatch 0 in the key); ZeRO 2 and 3
    reduce-scatter each microbatch's gradients apart."""
    backward = Action("B", 3, 5)
    keys = [step._reduce_key(backward, 1, zero) for zero in (0, 1, 2, 3)]
    assert keys == [("ar", 3, 0, 1), ("rs", 3, 0, 1), ("rs", 3, 5, 1), ("rs", 3, 5, 1)]


def test_weight_buckets_of_a_third_of_a_stage_are_not_rounded(tmp_path):
    """One pipeline rank of 1,064 parameters in 3 buckets over a ring of 2: ZeRO 1 gathers each bucket
    once before the forward, 2 · 1,064 / 3 B of which the ring moves half at 1,024 B/s; ZeRO 3 gathers
    them for the forward (alone on the NIC: timed here) and again for the backward."""
    bucket = 2 * 1064 / 3 / 2 / 1024
    # nemo gathers ZeRO 1's weights beside the forward (fourd's ZeRO 1 gathers after the update)
    for zero, gathers, stack in ((1, 3, "nemo"), (3, 6, "fsdp"), (1, 3, "fourd")):
        comm = build_comm(_job(_cluster(tmp_path), Layout(dp=2), zero=zero, stack=stack))
        r = simulate(build_schedule("1f1b", 1, 1), [UNIT], layers=[3], comm=comm)
        times = [t.end - t.start for t in r.transfers if t.kind == "ag"]
        assert len(times) == gathers
        assert times[:3] == pytest.approx([bucket] * 3, rel=1e-12), zero


def test_a_transfer_names_the_replica_class_and_the_rank_that_sends(tmp_path):
    """A straggler on rank 1 of one of two replicas: both classes reduce gradients; each transfer says
    which class and which pipeline rank sent it."""
    comm = build_comm(_job(_cluster(tmp_path), zero=1, microbatches=2, stack="nemo"))
    r = simulate(
        build_schedule("1f1b", 2, 2), [UNIT] * 2, layers=[2, 2], comm=comm, slow=(1, 2), dp=2
    )
    sent = {(t.replica, t.rank, t.kind) for t in r.transfers if t.kind != "pp"}
    assert sent == {
        (replica, rank, kind) for replica in (0, 1) for rank in (0, 1) for kind in ("ag", "rs")
    }


def test_unit_costs_split_a_backward_into_equal_halves():
    assert step.UNIT == {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    assert step.UNIT["B"] == step.UNIT["I"] + step.UNIT["W"]


def test_stage_costs_carry_tp_collectives_unless_asked_not_to(tmp_path):
    job = _job(_cluster(tmp_path, gpus_per_node=2), Layout(tp=2, pp=2), microbatches=1)
    with_comm, without = step.stage_costs(job), step.stage_costs(job, comm=False)
    from fourd.plan.perf import autocast_passes, chunk_times

    # fourd on one replica computes by autocast: each stage's forward also casts its weights
    assert job.work.autocast
    params = step.stage_params_on_gpu(job)
    for stage, (chunk, costs, bare) in enumerate(zip(chunk_times(job), with_comm, without)):
        casts = autocast_passes(job, params[stage]).forward_s
        assert chunk.forward_comm_s > 0
        assert costs["F"] == chunk.forward_s + casts + chunk.forward_comm_s
        assert bare["F"] == chunk.forward_s + casts
        assert costs["B"] == costs["I"] + costs["W"]


def test_the_pipeline_span_runs_from_the_first_start_to_the_last_end(tmp_path):
    """ZeRO-1 gathered beside the forward: the first forward waits for its weights, so the span starts
    at 0.2578125, not at 0."""
    r, _ = _collectives(tmp_path, 1)
    first_start = min(rank[0].start for rank in r.events)
    assert first_start == 0.2578125
    assert r.pipeline_span_s == max(rank[-1].end for rank in r.events) - first_start


def test_an_action_split_into_three_layers_sends_and_ends_with_its_last_piece(tmp_path):
    """ZeRO-1 beside the forward, three layers a stage: the first forward of each stage runs as three
    pieces, each after its layer's weights; its activation leaves, and its event ends, when the
    third ends."""
    comm = build_comm(_job(_cluster(tmp_path), zero=1, stack="nemo"))
    r = simulate(build_schedule("1f1b", 2, 1), [UNIT] * 2, layers=[3, 3], comm=comm)
    forward = r.events[0][0]
    (sent,) = [t for t in r.transfers if t.name == "act 0.0 to rank 1"]
    assert (forward.kind, sent.start) == ("F", forward.end)
    assert forward.end - forward.start == pytest.approx(1, rel=1e-12)
    assert r.events[1][0].start == sent.end  # no latency: it starts as the activation lands


def test_zero_bubble_sends_activations_after_f_only_and_zero3_gathers_for_f_and_i_only(tmp_path):
    """ZB-H1 on two ranks, two microbatches, one layer a stage: one activation and one input gradient
    cross per microbatch; ZeRO-3 gathers a layer's weights before each F and each I, never for W
    (the weight gradient needs the layer's input and output gradient, not its weights)."""
    comm = build_comm(_job(_cluster(tmp_path), zero=3, microbatches=2, stack="fsdp"))
    r = simulate(build_schedule("zero-bubble", 2, 2), [UNIT] * 2, layers=[1, 1], comm=comm)
    assert sorted(t.name for t in r.transfers if t.kind == "pp") == [
        "act 0.0 to rank 1",
        "act 0.1 to rank 1",
        "grad 1.0 to rank 0",
        "grad 1.1 to rank 0",
    ]
    for rank in (0, 1):
        assert len([t for t in r.transfers if t.kind == "ag" and t.rank == rank]) == 4


def test_a_straggler_past_the_256th_rank_of_a_300_stage_pipeline():
    """GPipe, one microbatch, F = 1 and B = 2 on each of 300 stages: 900 units; rank 280 of the
    straggler's replica twice as slow: 903. (CPython keeps one object per int only up to 256.)"""
    sched = build_schedule("gpipe", 300, 1)
    r = simulate(sched, [UNIT] * 300, slow=(280, 2), dp=2)
    assert r.step_time_s == 903
    assert [(e.kind, e.end - e.start) for e in r.slow_events[280]] == [("F", 2), ("B", 4)]
    assert (r.events[299][-1].end, r.events[0][-1].end) == (302, 900)


def test_neighbours_on_one_server_past_the_256th_talk_over_nvlink(tmp_path):
    """516 pipeline ranks, two a server: ranks 514 and 515 share server 257."""
    cluster = _cluster(tmp_path, gpus_per_node=2)
    model = ModelConfig(layers=514, dim=8, ffn=8, heads=1, kv_heads=1, vocab=8)
    par = Parallelism(layout=Layout(pp=516), microbatches=1, zero=0)
    comm = build_comm(Job(model, cluster, par, 64, 1))
    assert comm.p2p[(514, 515)][0] == ("nvl_out", "nvl_in")
    assert comm.p2p[(513, 514)][0] == ("nic_out", "nic_in")


def test_a_slow_gpu_of_a_negative_factor_is_refused(tmp_path):
    with pytest.raises(FourdError, match=r"slow GPU 0:-1.0: .* and a factor > 0"):
        simulate_step(_job(_cluster(tmp_path)), slow_gpu=(0, -1.0))


def test_the_bubble_share_of_a_step_shorter_than_a_second():
    """1F1B, two ranks, two microbatches, F 0.1 s and B 0.2 s: a span of 0.9 s, 0.6 s busy a rank."""
    r = simulate(build_schedule("1f1b", 2, 2), [{"F": 0.1, "B": 0.2}] * 2)
    assert r.pipeline_span_s == pytest.approx(0.9, rel=1e-12)
    assert r.bubble_fraction == pytest.approx(1 / 3, rel=1e-12)


def test_every_sharded_stage_steps_the_optimizer_over_its_shard(tmp_path):
    cluster = _cluster(tmp_path)
    for zero in (2, 3):
        job = _job(cluster, Layout(pp=2, dp=3), zero=zero, stack="fsdp")
        assert simulate_step(job, comm=False).optimizer_s == [
            optimizer_time(528 / 3, cluster, 2),
            optimizer_time(536 / 3, cluster, 2),
        ], zero


def test_events_and_transfers_are_immutable_and_results_named_by_keywords(tmp_path):
    event = Event(rank=0, stage=0, kind="F", microbatch=0, start=0, end=1)
    transfer = step.Transfer(replica=0, rank=0, kind="pp", name="x", start=0, end=1)
    comm = build_comm(_job(_cluster(tmp_path)))
    for value in (event, transfer, comm):
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.rank = 1  # type: ignore[misc]
    for cls, value in ((Event, event), (step.Transfer, transfer)):
        with pytest.raises(TypeError):
            cls(*dataclasses.astuple(value))
    result = simulate(build_schedule("gpipe", 1, 1), [UNIT])
    with pytest.raises(TypeError):
        step.StepResult(*[getattr(result, f.name) for f in dataclasses.fields(result)])
    # a Comm left without the flag gathers ZeRO 1's weights beside the forward
    fields = {f.name: getattr(comm, f.name) for f in dataclasses.fields(comm)}
    del fields["gather_in_step"]
    assert step.Comm(**fields).gather_in_step is False


def test_the_simulators_options_are_keywords_and_one_replica_is_the_stragglers():
    sched = build_schedule("gpipe", 1, 1)
    with pytest.raises(TypeError):
        simulate(sched, [UNIT], [1])  # type: ignore[misc]
    alone = simulate(sched, [UNIT], slow=(0, 2))
    assert (alone.step_time_s, alone.slow_events) == (6, None)


def test_a_delivery_lands_after_its_latency_even_with_a_later_one_waiting(tmp_path):
    """GPipe, two ranks on two servers, two microbatches, a 3 s latency: activation 0 crosses [1, 2]
    and lands at 2 + 3; activation 1 crosses [2, 3] and lands later. Rank 1 starts at the first."""
    folder = tmp_path / "latency"
    folder.mkdir()
    comm = build_comm(_job(_cluster(folder, latency_us=3e6), microbatches=2))
    latency = comm.p2p[(0, 1)][2]
    r = simulate(build_schedule("gpipe", 2, 2), [UNIT] * 2, comm=comm)
    assert r.events[1][0].start == 2 + latency


def test_a_schedule_of_no_actions_spans_nothing():
    empty = Schedule(name="empty", pp=1, microbatches=0, virtual_stages=1, ranks=((),))
    r = simulate(empty, [UNIT])
    assert (r.step_time_s, r.pipeline_span_s, r.events) == (0, 0.0, [[]])


def test_a_stage_of_one_layer_gathers_and_reduces_one_bucket(tmp_path):
    r = simulate_step(_job(_cluster(tmp_path), zero=1, microbatches=2, stack="nemo"))
    for rank in (0, 1):
        names = sorted(t.name for t in r.transfers if t.rank == rank and t.kind in ("ag", "rs"))
        assert names == [f"all_gather stage {rank} layer 0", f"reduce_scatter stage {rank} layer 0"]


def test_one_gpu_is_simulated_without_a_slow_gpu(tmp_path):
    job = _job(_cluster(tmp_path), Layout())
    r = simulate_step(job)
    (costs,) = step.stage_costs(job)
    expected = costs["F"] + costs["B"] + r.optimizer_s[0]
    assert r.step_time_s == pytest.approx(expected, rel=1e-12)
    assert r.slow_events is None


def test_a_stage_of_300_layers_split_into_its_buckets_ends_each_action_with_its_last(tmp_path):
    """ZeRO-1 beside the forward on one rank of 300 layers (past CPython's 256 cached ints): the
    forward and the backward each run as 300 pieces and record one event each."""
    model = ModelConfig(layers=300, dim=8, ffn=8, heads=1, kv_heads=1, vocab=8)
    par = Parallelism(layout=Layout(dp=2), microbatches=1, zero=1)
    comm = build_comm(Job(model, _cluster(tmp_path), par, 64, 2, stack="nemo"))
    r = simulate(build_schedule("1f1b", 1, 1), [UNIT], layers=[300], comm=comm)
    assert [e.kind for e in r.events[0]] == ["F", "B"]
    assert len([t for t in r.transfers if t.kind == "rs"]) == 300


def test_zero_bubble_records_every_weight_gradient(tmp_path):
    comm = build_comm(_job(_cluster(tmp_path), zero=3, microbatches=2, stack="fsdp"))
    r = simulate(build_schedule("zero-bubble", 2, 2), [UNIT] * 2, layers=[1, 1], comm=comm)
    for rank in (0, 1):
        assert sorted(e.kind for e in r.events[rank]) == ["F", "F", "I", "I", "W", "W"]


def test_the_last_of_300_stages_sends_no_activation(tmp_path):
    """300 pipeline ranks on one-GPU servers, one microbatch: 299 activations forward, 299 input
    gradients back."""
    model = ModelConfig(layers=298, dim=8, ffn=8, heads=1, kv_heads=1, vocab=8)
    par = Parallelism(layout=Layout(pp=300), microbatches=1, zero=0)
    comm = build_comm(Job(model, _cluster(tmp_path), par, 64, 1))
    r = simulate(build_schedule("gpipe", 300, 1), [UNIT] * 300, comm=comm)
    names = [t.name for t in r.transfers]
    assert len(names) == 598
    assert len([name for name in names if name.startswith("act")]) == 299
