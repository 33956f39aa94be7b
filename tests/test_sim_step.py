"""The step simulator: the schedule's bubble exactly without communication, the planner's step time
with it, contention on shared links, pods, stragglers, the diurnal throttle and the trace."""

import json
import subprocess
import sys
from fractions import Fraction

import pytest

from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism
from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.memory import stage_params
from fourd.plan.perf import autocast_passes, chunk_times
from fourd.schedules import build_schedule
from fourd.sim.network import Flow, Network
from fourd.sim.step import simulate, simulate_step, stage_costs, timeline
from fourd.sim.step_cli import diurnal_factor

UNIT = {"F": 1, "B": 2, "I": 1, "W": 1}


@pytest.mark.slow  # seconds of exact schedules up to 16 ranks
def test_no_comm_equal_stages_idle_fraction_exact_gpipe_1f1b():
    for name in ("gpipe", "1f1b"):
        for p in range(1, 17):
            for m in range(1, 65):
                r = simulate(build_schedule(name, p, m), [UNIT] * p)
                assert r.step_time_s == 3 * (m + p - 1)
                assert [Fraction(r.step_time_s - b, r.step_time_s) for b in r.busy_s] == [
                    Fraction(p - 1, m + p - 1)
                ] * p


@pytest.mark.slow  # seconds of exact schedules up to 16 ranks
def test_no_comm_interleaved_bubble_over_compute_exact():
    for p, v in [(p, 2) for p in range(2, 17)] + [(4, 4), (8, 4), (16, 4)]:
        for m in range(p, 65, p):
            r = simulate(build_schedule("interleaved", p, m, v), [UNIT] * (p * v))
            assert [Fraction(r.pipeline_span_s - b, b) for b in r.busy_s] == [
                Fraction(p - 1, v * m)
            ] * p


def test_bubble_fraction_is_the_busiest_ranks_idle_share_of_the_span():
    # GPipe, 2 microbatches, the second stage twice as slow: F0 [0,1] [1,2], F1 [1,3] [3,5], B1 [5,9] [9,13],
    # B0 [9,11] [13,15]; rank 1 computes 12 of the 15 units, rank 0 only 6
    r = simulate(build_schedule("gpipe", 2, 2), [UNIT, {k: 2 * t for k, t in UNIT.items()}])
    assert (r.pipeline_span_s, r.busy_s) == (15, [6, 12])
    assert r.bubble_fraction == pytest.approx(1 - 12 / 15, abs=1e-15)


def test_links_are_shared_equally_and_fractions_count():
    net = Network({"nic": 10.0, "nvl": 100.0})
    done = []
    net.add(Flow(size=100.0, links=((("nic",), 1.0),), cap=1e9, latency=0.0, done=done.append), 0.0)
    net.add(Flow(size=100.0, links=((("nic",), 1.0),), cap=1e9, latency=0.0, done=done.append), 0.0)
    net.add(
        Flow(
            size=100.0,
            links=((("nic",), 0.25), (("nvl",), 1.0)),
            cap=30.0,
            latency=0.0,
            done=done.append,
        ),
        0.0,
    )
    # three users of the NIC get 10/3 each; the third puts only a quarter of its bytes on it: 40/3
    assert net.next_finish(0.0) == pytest.approx(7.5)
    assert [f.rate for f in net.flows] == pytest.approx([10 / 3, 10 / 3, 40 / 3])
    assert len(net.advance(0.0, 7.5)) == 1
    assert net.next_finish(7.5) == pytest.approx(7.5 + (100 - 25) / 5)  # the two left share the NIC


def _plan(model, cluster, layout, seq, tokens, schedule, **fixed):
    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    values = {
        "layout": layout,
        "seq": seq,
        "global_batch_tokens": tokens,
        "schedule": schedule,
        **fixed,
    }
    return request.plans(request.resolve(get_preset(model), cluster, values))[0]


def _sim(plan, **kw):
    return simulate_step(plan.job, **kw)


@pytest.mark.parametrize(
    "layout,seq",
    [("tp=8,pp=16,dp=64", 8192), ("tp=8,pp=16,dp=128", 8192), ("tp=8,cp=16,pp=16,dp=8", 131072)],
)
def test_table4_layouts_agree_with_the_planner_within_10_percent(layout, seq):
    plan = _plan("llama3-405b", "llama3-h100", layout, seq, 2**24, "interleaved")
    r = _sim(plan)
    assert abs(r.step_time_s / plan.step.step_s - 1) < 0.10
    # 16,384 GPUs, simulated as one pipeline of 16 ranks
    assert len(r.per_rank_idle_fraction) == 16


def _two_pod_cluster(tmp_path, gpus_per_pod):
    path = tmp_path / f"pods{gpus_per_pod}.toml"
    path.write_text(f"""name = "two-pods"
[gpu]
name = "H100"
peak_tflops = 989.0
memory_gb = 80.0
hbm_bw_gbps = 3350.0
sms = 132
[node]
gpus = 8
intra_bw_gbps = 450.0
[network]
nic_bw_gbps = 50.0
latency_us = 10.0
gpus_per_rack = {min(16, gpus_per_pod)}
gpus_per_pod = {gpus_per_pod}
cross_pod_oversubscription = 7.0
""")
    return load_cluster(str(path))


def test_dp_group_over_two_pods_is_seven_times_slower(tmp_path):
    # One replica fills a server (tp=8); two replicas. With 8-GPU pods every GPU's gradient ring crosses the
    # 1:7 oversubscribed uplinks; with a 16-GPU pod it stays inside.
    dp_time, step = {}, {}
    for pod in (8, 16):
        plan = _plan(
            "llama3-8b",
            _two_pod_cluster(tmp_path, pod),
            "tp=8,dp=2",
            8192,
            8 * 8192,
            "1f1b",
            microbatches=4,
            zero=0,
        )
        r = _sim(plan)
        buckets = [t for t in r.transfers if t.kind == "ar"]
        # each bucket pays 2 ring steps of 10 µs latency on top of its bytes
        dp_time[pod] = sum(t.end - t.start for t in buckets) - len(buckets) * 2 * 10e-6
        step[pod] = r.step_time_s
    assert dp_time[8] / dp_time[16] == pytest.approx(
        7.0, rel=1e-6
    )  # bandwidth-bound: the 1:7 factor
    assert step[8] > step[16] * 1.05


def test_nic_shared_by_pipeline_and_gradient_traffic_slows_both(tmp_path):
    plan = _plan(
        "llama3-8b",
        "llama3-h100",
        "tp=8,pp=4,dp=4",
        8192,
        64 * 8192,
        "1f1b",
        microbatches=16,
        zero=2,
    )
    r = _sim(plan)
    # ZeRO-2 reduce-scatters every microbatch's gradients while activations and gradients cross the same NICs
    pp = [t for t in r.transfers if t.kind == "pp"]
    rs = [t for t in r.transfers if t.kind == "rs"]
    fastest = min(t.end - t.start for t in pp)
    beside = [
        t for t in pp if any(u.rank == t.rank and u.start < t.end and t.start < u.end for u in rs)
    ]
    assert len(beside) > 10
    assert sum(t.end - t.start for t in beside) / len(beside) > 1.3 * fastest


def test_straggler_sets_the_pace_and_the_others_wait():
    s = build_schedule("1f1b", 4, 8)
    slow = simulate(s, [UNIT] * 4, slow=(2, 2), dp=4)
    alone = timeline(
        s, [{k: t * (2 if st == 2 else 1) for k, t in UNIT.items()} for st in range(4)]
    )
    assert slow.slow_events == alone
    # the healthy replicas run at full speed (no collectives here): their timeline is the plain one
    assert slow.events == timeline(s, UNIT)
    plan = _plan(
        "llama3-8b",
        "llama3-h100",
        "tp=8,pp=4,dp=4",
        8192,
        64 * 8192,
        "1f1b",
        microbatches=16,
        zero=1,
    )
    base, straggled = _sim(plan), _sim(plan, slow_gpu=(8 * 2 + 3, 1.3))
    assert straggled.step_time_s > base.step_time_s * 1.05
    # every replica waits for the slow one in the gradient collectives: the healthy ones idle more
    assert sum(straggled.per_rank_idle_fraction) > sum(base.per_rank_idle_fraction) + 0.1


def test_diurnal_throttle_scales_compute():
    assert diurnal_factor(2.0, 15) == pytest.approx(1.02)
    assert diurnal_factor(2.0, 3) == 1.0
    assert diurnal_factor(2.0, 9) == pytest.approx(1.01)
    plan = _plan(
        "llama3-8b", "llama3-h100", "tp=8,pp=4,dp=4", 8192, 64 * 8192, "1f1b", microbatches=16
    )
    assert _sim(plan, comm=False, throttle=1.02).step_time_s == pytest.approx(
        1.02 * _sim(plan, comm=False).step_time_s
    )


def test_cli_json_trace_and_the_big_step(tmp_path):
    trace = tmp_path / "t.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fourd",
            "sim",
            "step",
            "--model",
            "llama3-405b",
            "--gpus",
            "16384",
            "--layout",
            "tp=8,pp=16,dp=128",
            "--seq",
            "8192",
            "--global-batch-tokens",
            "16M",
            "--schedule",
            "1f1b",
            "--microbatches",
            "16",
            "--trace",
            str(trace),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert (
        len(d["per_rank_idle_fraction"]) == 16
        and d["microbatches"] == 16
        and d["schedule"] == "1f1b"
    )
    assert abs(d["step_time_s"] / d["planner_step_time_s"] - 1) < 0.10
    events = json.loads(trace.read_text())["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert len(compute) == 16 * 16 * 2
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "fourd",
            "sim",
            "step",
            "--model",
            "llama3-8b",
            "--layout",
            "tp=8,dp=2",
            "--slow-gpu",
            "99:1.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        bad.returncode == 2
        and "slow GPU 99:1.5: give a rank in 0..15 of layout tp=8,cp=1,pp=1,dp=2" in bad.stderr
    )


def test_cli_search_ranks_the_planners_candidates_by_simulated_time():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fourd",
            "sim",
            "step",
            "--model",
            "llama3-8b",
            "--gpus",
            "64",
            "--seq",
            "8192",
            "--global-batch-tokens",
            "1M",
            "--search",
            "--top",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    times = [c["step_time_s"] for c in d["candidates"]]
    assert len(times) == 3 and times == sorted(times) and d["best"]["step_time_s"] == times[0]
    # each candidate's time is the simulated step of its own configuration, and it is the planner's top three
    req = request.resolve(
        get_preset("llama3-8b"),
        load_cluster("llama3-h100"),
        {"gpus": 64, "seq": 8192, "global_batch_tokens": 2**20},
    )
    top = [p for p in request.plans(req) if p.fits][:3]
    key = ("layout", "schedule", "microbatches", "virtual_stages", "zero", "recompute")
    mine = {tuple(str(c[k]) for k in key): c["step_time_s"] for c in d["candidates"]}
    assert len(top) == 3
    for p in top:
        lay = p.config.layout
        k = (
            str({"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp}),
            p.config.schedule,
            str(p.config.microbatches),
            str(p.config.virtual_stages),
            str(p.config.zero),
            p.config.recompute,
        )
        assert mine[k] == simulate_step(p.job).step_time_s


@pytest.mark.parametrize(
    "where,message", [("missing/step.json", "which is not a folder"), (".", "is a folder")]
)
def test_trace_path_is_checked_before_simulating(tmp_path, where, message):
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "fourd",
            "sim",
            "step",
            "--model",
            "debug",
            "--gpus",
            "2",
            "--trace",
            str(tmp_path / where),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = bad.stderr.strip().splitlines()
    assert (
        bad.returncode == 2
        and len(lines) == 1
        and "argument --trace" in lines[0]
        and message in lines[0]
    )


def test_one_sequence_per_replica_on_16384_gpus_simulates():
    # 2048 sequences of 8192 tokens (the default batch) cannot cover 16,384 replicas: refused, no division by zero
    from fourd.lab import api

    query = {"gpus": "16384", "layout": "tp=1,pp=1,dp=16384", "seq": "8192"}
    with pytest.raises(
        FourdError, match="2048 sequences does not split into dp × microbatches = 16384 × 1"
    ):
        api.simtrace(query)
    query["global_batch_tokens"] = str(16384 * 8192)
    trace = api.simtrace(query)
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0] == [
        "F0.0",
        "B0.0",
    ]
    plan = api.plan(query)["plan"]
    assert plan["global_batch_tokens"] == 16384 * 8192 and plan["microbatches"] == 1


def test_a_stage_under_autocast_pays_its_own_weights_casts_and_gradient_sums():
    """Lightning's autocast over FP32 weights on two pipeline stages of a 4-layer model: each
    stage's F and W are the planner's chunk times plus autocast_passes of the parameters the stage
    holds (the embedding on the first, the output and final norm on the last); I is unchanged."""
    model = get_preset("debug")
    par = Parallelism(layout=Layout(pp=2), schedule="1f1b", microbatches=4)
    job = Job(model, load_cluster("dgx-h100"), par, 64, 4, stack="lightning")
    assert job.work.autocast
    counts = job.stage_layers
    for stage, (costs, chunk) in enumerate(zip(stage_costs(job), chunk_times(job))):
        passes = autocast_passes(job, stage_params(model, counts, stage))
        assert passes.forward_s > 0 and passes.weight_grad_s > 0
        forward = chunk.forward_s + chunk.forward_comm_s + passes.forward_s
        assert costs["F"] == pytest.approx(forward, rel=1e-12)
        assert costs["W"] == pytest.approx(chunk.weight_grad_s + passes.weight_grad_s, rel=1e-12)
        assert costs["I"] == chunk.input_grad_s + chunk.backward_comm_s
