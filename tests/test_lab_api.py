"""The lab's API returns the project's own schedules and placements, with the published bubble figures."""

from __future__ import annotations

from fractions import Fraction

import pytest

from fourd.errors import FourdError
from fourd.lab import api
from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.cluster import load_cluster
from fourd.plan.stack import preset_names
from fourd.schedules import build_schedule
from fourd.sim.step import timeline


def bench(p, m, schedule="gpipe", v=None):
    q = {"p": str(p), "m": str(m), "schedule": schedule}
    if v is not None:
        q["v"] = str(v)
    return api.schedule(q)


@pytest.mark.parametrize("p,m,percent", [(16, 16, "48.4"), (16, 64, "19.0"), (1, 64, "0.0")])
def test_gpipe_bubble_figures(p, m, percent):
    """GPipe's bubble (p−1)/(m+p−1) (Huang et al. 2019): p=16 idles 48.4 % at m=16 and 19.0 % at m=64."""
    assert f"{100 * bench(p, m)['idle_fraction']:.1f}" == percent


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 7), (5, 16), (16, 1), (16, 16), (16, 64), (7, 64)])
def test_gpipe_and_1f1b_match_the_bubble_formulas(schedule, p, m):
    """Idle (p−1)/(m+p−1) and speed-up over one GPU running every stage p·m/(m+p−1) (Huang et al. 2019)."""
    d = bench(p, m, schedule)
    assert d["idle_fraction"] == pytest.approx(float(Fraction(p - 1, m + p - 1)), abs=1e-12)
    assert d["speedup"] == pytest.approx(float(Fraction(p * m, m + p - 1)), rel=1e-12)
    assert d["makespan"] == 3 * (m + p - 1)  # forward 1, backward 2


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (8, 32, 4), (16, 64, 2)])
def test_interleaved_keeps_the_work_and_shrinks_the_bubble_by_v(p, m, v):
    """Each of V stages per GPU holds 1/V of its layers; bubble/compute = (p−1)/(V·m) (Narayanan et al. 2021)."""
    d = bench(p, m, "interleaved", v)
    compute = 3 * m
    assert d["makespan"] == pytest.approx(compute + 3 * (p - 1) / v, rel=1e-12)
    assert d["idle_fraction"] == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
    assert all(r["stages"] == [r["rank"] + k * p for k in range(v)] for r in d["ranks"])
    assert {e[4] for r in d["ranks"] for e in r["events"]} == {1 / v, 2 / v}


def test_zero_bubble_idles_one_forward_per_stage():
    """ZB-H1 with unit F, I, W idles (p−1)·(T_F + T_I − T_W) = p−1 units per rank (fourd.schedules)."""
    p, m = 4, 8
    d = bench(p, m, "zero-bubble")
    assert d["makespan"] == 3 * m + (p - 1)
    assert d["idle_fraction"] == pytest.approx((p - 1) / (3 * m + p - 1), rel=1e-12)
    kinds = [sorted({e[0] for e in r["events"]}) for r in d["ranks"]]
    assert kinds == [["F", "I", "W"]] * p


@pytest.mark.parametrize(
    "schedule,v,per_rank",
    [("gpipe", None, 2), ("1f1b", None, 2), ("zero-bubble", None, 3), ("interleaved", 2, 4)],
)
def test_events_are_the_simulators_timeline(schedule, v, per_rank):
    p, m = 4, 8
    d = bench(p, m, schedule, v)
    sched = build_schedule(schedule, p, m, v or 1)
    scale = v or 1
    expected = timeline(sched, {"F": 1 / scale, "B": 2 / scale, "I": 1 / scale, "W": 1 / scale})
    for r, rank in enumerate(d["ranks"]):
        assert len(rank["events"]) == per_rank * m
        assert rank["events"] == [
            [e.kind, e.stage, e.microbatch, e.start, e.end - e.start] for e in expected[r]
        ]
        assert rank["peak_in_flight"] == sched.peak_in_flight(r)


def test_peak_in_flight_gpipe_holds_all_1f1b_holds_p_minus_rank():
    """1F1B keeps at most p microbatches of activations in flight, GPipe m (Narayanan et al. 2021)."""
    assert [r["peak_in_flight"] for r in bench(4, 16, "gpipe")["ranks"]] == [16, 16, 16, 16]
    assert [r["peak_in_flight"] for r in bench(4, 16, "1f1b")["ranks"]] == [4, 3, 2, 1]


def test_cluster_row_of_one_llama3_replica():
    d = api.cluster({"layout": "tp=8,pp=16"})
    assert (d["racks"], d["servers_per_rack"], d["gpus_per_server"], d["world"]) == (8, 2, 8, 128)
    assert len(d["gpus"]) == 128
    g = d["gpus"][77]  # rank = tp + 8·pp: tp 5, pp 9, on server 9 of rack 4
    assert g == {
        "rank": 77,
        "server": 9,
        "rack": 4,
        "coords": {"tp": 5, "cp": 0, "pp": 9, "dp": 0},
        "groups": {"tp": 72, "cp": 77, "pp": 5, "dp": 77},
    }
    assert d["spans"] == {
        "tp": {"size": 8, "groups": 16, "levels": {"nvlink": 16}},
        "cp": {"size": 1, "groups": 128, "levels": {}},
        "pp": {"size": 16, "groups": 8, "levels": {"pod": 8}},
        "dp": {"size": 1, "groups": 128, "levels": {}},
    }


def test_groups_that_straddle_servers_are_counted_where_they_lie():
    """tp=3 on 8-GPU servers: TP groups [3k, 3k+2]; k = 2 and 13 cross a server inside a rack (6-8, 39-41),
    k = 5 and 10 cross a rack (15-17, 30-32); the other 12 stay inside one server."""
    d = api.cluster({"layout": "tp=3,pp=16"})
    assert d["spans"]["tp"] == {
        "size": 3,
        "groups": 16,
        "levels": {"nvlink": 12, "rack": 2, "pod": 2},
    }
    assert [g["server"] for g in d["gpus"][6:9]] == [0, 0, 1]


def test_cluster_row_shows_the_first_replica_of_a_large_layout():
    d = api.cluster({"layout": "tp=8,pp=16,dp=128"})
    assert (d["world"], len(d["gpus"])) == (16384, 128)
    assert d["spans"]["dp"] == {"size": 128, "groups": 128, "levels": {"cross-pod": 128}}
    d = api.cluster({"layout": "tp=2,cp=2"})
    assert [g["groups"]["cp"] for g in d["gpus"]] == [0, 1, 0, 1]
    assert [g["groups"]["tp"] for g in d["gpus"]] == [0, 0, 2, 2]


def test_cluster_row_takes_any_number_of_gpus():
    # a profile describes a server, a pod and the network, not a size
    d = api.cluster(
        {"layout": "tp=8,pp=16,dp=256"}
    )  # 32,768 GPUs, more than llama3-h100's 8 pods of 3,072
    assert (d["world"], len(d["gpus"]), d["spans"]["dp"]["levels"]) == (
        32768,
        128,
        {"cross-pod": 128},
    )
    with pytest.raises(FourdError) as e:
        api.cluster({"layout": "tp=8,pp=16,dp=131072"})
    assert (
        str(e.value)
        == "layout=tp=8,cp=1,pp=16,dp=131072 has 16,777,216 GPUs: the cluster row counts at most 1,048,576"
    )


def test_trace_opens_only_chrome_json_under_the_trace_dir(tmp_path):
    (tmp_path / "runs").mkdir()
    events = [{"name": "F0.0", "ph": "X", "ts": 0, "dur": 5, "pid": 0, "tid": 0}]
    (tmp_path / "runs" / "trace.json").write_text(
        '{{"traceEvents": {}}}'.format(str(events).replace("'", '"'))
    )
    (tmp_path / "runs" / "list.json").write_text(
        '[{"name": "B0.0", "ph": "X", "ts": 1, "dur": 2, "pid": 1, "tid": 0}]'
    )
    (tmp_path / "runs" / "bad.json").write_text("{not json")
    (tmp_path / "runs" / "notes.txt").write_text("x")
    root = tmp_path / "runs"
    assert api.trace({"path": "trace.json"}, trace_dir=root) == {
        "path": "trace.json",
        "traceEvents": events,
    }
    assert api.trace({"path": "list.json"}, trace_dir=root)["traceEvents"][0]["name"] == "B0.0"
    with pytest.raises(FourdError, match="is not JSON"):
        api.trace({"path": "bad.json"}, trace_dir=root)
    with pytest.raises(FourdError, match="a trace is a Chrome trace .json file"):
        api.trace({"path": "notes.txt"}, trace_dir=root)
    with pytest.raises(FourdError, match="outside the lab's --trace-dir"):
        api.trace({"path": "../runs/../x.json"}, trace_dir=root)
    (root / "link.json").symlink_to(tmp_path / "outside.json")
    (tmp_path / "outside.json").write_text("[]")
    with pytest.raises(FourdError, match="outside the lab's --trace-dir"):
        api.trace({"path": "link.json"}, trace_dir=root)


def test_a_trace_over_the_size_limit_is_refused_unread(tmp_path):
    """64 MiB is read (and here found not to be JSON); one byte more is refused before reading."""
    for name, size in (("at.json", api.TRACE_MAX_BYTES), ("over.json", api.TRACE_MAX_BYTES + 1)):
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)  # sparse: no 64 MiB written
    with pytest.raises(FourdError) as e:
        api.trace({"path": "over.json"}, trace_dir=tmp_path)
    assert str(e.value) == "path='over.json' is larger than 64 MiB; open a shorter trace"
    with pytest.raises(FourdError, match=r"^path='at.json' is not JSON \("):
        api.trace({"path": "at.json"}, trace_dir=tmp_path)


PLAN_405B = {
    "model": "llama3-405b",
    "cluster": "llama3-h100",
    "gpus": "16384",
    "layout": "tp=8,pp=16,dp=128",
    "schedule": "interleaved",
    "microbatches": "16",
    "seq": "8192",
}


def test_plan_panel_is_fourd_plan_with_one_memory_bar_per_pipeline_rank():
    d = api.plan(PLAN_405B)
    plan = d["plan"]
    assert plan["layout"] == {"tp": 8, "cp": 1, "pp": 16, "dp": 128}
    assert (plan["schedule"], plan["microbatches"], plan["micro_batch_seqs"]) == (
        "interleaved",
        16,
        1,
    )
    assert plan["chosen_by_planner"] == ["virtual stages", "zero", "recompute", "compile"]
    assert d["gpu_memory_gb"] == 80.0
    assert [b["label"] for b in d["memory"]] == [f"pipeline rank {r}" for r in range(16)]
    # the plan's memory is its fullest GPU's
    assert max(b["total"] for b in d["memory"]) == pytest.approx(
        plan["memory_gb"]["total"], abs=1e-3
    )
    assert 0 < plan["mfu"] < 1 and d["why"][0].startswith(
        "Pipeline bubble: each replica gets 16 sequences"
    )


@pytest.mark.parametrize(
    "q,message",
    [
        (
            {"layout": "tp=8,pp=16", "gpus": "256"},
            "layout tp=8,cp=1,pp=16,dp=1 uses 128 GPUs but 256 are asked: make the product of the degrees equal 256",
        ),
        (
            {"model": "llama3-1t", "gpus": "8"},
            "model='llama3-1t': choose one of debug, small, llama3-8b, llama3-70b, llama3-405b",
        ),
        ({"gpus": "0"}, "gpus 0 is out of range: give a whole number from 1 to 1,048,576"),
        (
            {"gpus": "8", "seq": "8192", "global_batch_tokens": "1000"},
            "a global batch of 1000 tokens is not a whole number of 8192-token sequences: use a multiple of 8192",
        ),
        (
            {**PLAN_405B, "schedule": "gpipe", "v": "2"},
            "2 virtual stages need the interleaved schedule (gpipe runs one stage per rank): choose the interleaved "
            "schedule or one virtual stage",
        ),
        (
            {**PLAN_405B, "cluster": "../x"},
            "cluster='../x': give a cluster profile name such as llama3-h100",
        ),
        (
            {**PLAN_405B, "stack": "/etc/passwd.toml"},
            "stack='/etc/passwd.toml': choose one of deepspeed, fourd, fsdp, fsdp2, internevo, jax-xla, lightning, "
            "megatron-core, megatron-lm, nanotron, nemo, paddle",
        ),
    ],
)
def test_plan_panel_refuses_bad_settings(q, message):
    with pytest.raises(FourdError) as e:
        api.plan(q)
    assert str(e.value) == message


def test_plan_panel_plans_on_the_chosen_stack_as_fourd_plan_does():
    assert api.options({})["stacks"] == preset_names()
    q = {**PLAN_405B, "stack": "nemo"}
    plan = api.plan(q)["plan"]
    assert (plan["stack"], plan["tp_overlap"], plan["dp_overlap"]) == ("nemo", True, True)
    model, cluster = get_preset("llama3-405b"), load_cluster("llama3-h100")
    values = {"virtual_stages" if k == "v" else k: v for k, v in q.items() if k != "model"}
    values.pop("cluster")
    same = request.plans(request.resolve(model, cluster, values))[0]
    assert plan["step_time_s"] == same.step.step_s
    assert plan["step_time_s"] < api.plan(PLAN_405B)["plan"]["step_time_s"]


def test_simulated_trace_runs_the_schedules_actions_with_transfers():
    q = {
        "model": "debug",
        "gpus": "8",
        "layout": "pp=4,dp=2",
        "schedule": "1f1b",
        "microbatches": "8",
        "seq": "256",
        "global_batch_tokens": "8192",
    }
    events = api.simtrace(q)["traceEvents"]
    sched = build_schedule("1f1b", 4, 8)
    for r in range(4):
        compute = sorted(
            (e for e in events if e["ph"] == "X" and e["tid"] == 2 * r), key=lambda e: e["ts"]
        )
        assert [e["name"] for e in compute] == [str(a) for a in sched.ranks[r]]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in zip(compute, compute[1:]))
    sends = {e["cat"] for e in events if e["ph"] == "X" and e["tid"] % 2 == 1}
    assert {"pp"} <= sends and sends & {"ag", "rs", "ar"}


def test_a_query_names_each_parameter_once_and_only_those_the_endpoint_takes():
    assert api.single_values([("p", "4"), ("m", "8")]) == {"p": "4", "m": "8"}
    with pytest.raises(FourdError) as e:
        api.single_values([("p", "4"), ("m", "8"), ("p", "2")])
    assert str(e.value) == "parameter 'p' is given twice; give it once"
    with pytest.raises(FourdError) as e:
        api.schedule({"p": "4", "m": "8", "q": "1"})
    assert str(e.value) == "unknown parameter 'q'; this endpoint takes p, m, schedule, v"


@pytest.mark.parametrize(
    "q,message",
    [
        ({"m": "8"}, "missing parameter p: give an integer from 1 to 16"),
        ({"p": "0", "m": "8"}, "p=0 is out of range: give an integer from 1 to 16"),
        ({"p": "17", "m": "8"}, "p=17 is out of range: give an integer from 1 to 16"),
        ({"p": "4", "m": "0"}, "m=0 is out of range: give an integer from 1 to 64"),
        ({"p": "4", "m": "65"}, "m=65 is out of range: give an integer from 1 to 64"),
        ({"p": "4", "m": "8", "v": "0"}, "v=0 is out of range: give an integer from 1 to 8"),
        ({"p": "4", "m": "8", "v": "9"}, "v=9 is out of range: give an integer from 1 to 8"),
        ({"p": "4", "m": "-1"}, "m='-1' is not a whole number: give an integer from 1 to 64"),
        (
            {"p": "x" * 50, "m": "8"},
            f"p={'x' * 40!r} is not a whole number: give an integer from 1 to 16",
        ),
        (
            {"p": "4", "m": "8", "schedule": "y" * 50},
            f"schedule={'y' * 40!r}: choose one of gpipe, 1f1b, interleaved, zero-bubble",
        ),
    ],
)
def test_the_benchs_sliders_take_whole_numbers_within_their_ranges(q, message):
    with pytest.raises(FourdError) as e:
        api.schedule(q)
    assert str(e.value) == message


def test_the_sliders_ends_are_accepted():
    assert api.schedule({"p": "1", "m": "1"})["makespan"] == 3  # one forward and one backward of 2
    widest = api.schedule({"p": "16", "m": "64", "schedule": "interleaved", "v": "8"})
    assert (widest["p"], widest["m"], widest["v"]) == (16, 64, 8)


def _job(layers, pp, microbatches, schedule="1f1b", virtual_stages=1):
    from fourd.layout import Layout, Parallelism
    from fourd.model.config import with_overrides
    from fourd.plan.job import Job

    par = Parallelism(
        layout=Layout(pp=pp),
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
    )
    model = with_overrides(get_preset("debug"), layers=layers)
    return Job(model, load_cluster("dgx-h100"), par, 256, microbatches)


def test_the_lab_simulates_at_most_10000_compute_pieces():
    """Pieces: microbatches × the layers of all stages (an empty stage counts one) × passes (2; 3 for
    zero-bubble, its backward split in two)."""
    api._check_sim_size(_job(50, 1, 100))  # 100 × 50 × 2 = 10,000
    with pytest.raises(FourdError) as e:
        api._check_sim_size(_job(50, 1, 101))
    assert str(e.value) == (
        "the step to simulate has 101 microbatches x 50 layers x 2 passes = 10,100 compute pieces; the lab "
        "simulates at most 10,000: give microbatches=100 or fewer, or run `fourd sim step` for the whole step"
    )
    api._check_sim_size(_job(50, 1, 66, "zero-bubble"))  # 66 × 50 × 3 = 9,900
    with pytest.raises(
        FourdError, match=r"67 microbatches x 50 layers x 3 passes = 10,050 .* microbatches=66 or"
    ):
        api._check_sim_size(_job(50, 1, 67, "zero-bubble"))
    # 2 layers on 4 stages: [0, 1, 1, 0], the empty stages a piece each: 4 × 2 × 1,250 = 10,000
    api._check_sim_size(_job(2, 4, 1250))
    with pytest.raises(
        FourdError, match=r"1,251 microbatches x 4 layers x 2 passes .* microbatches=1250 or"
    ):
        api._check_sim_size(_job(2, 4, 1251))
    # a step whose microbatch alone is more than the limit: one microbatch is the fewest to give
    with pytest.raises(FourdError, match=r"microbatches=1 or fewer"):
        api._check_sim_size(_job(6000, 1, 1))


def test_the_cluster_row_counts_groups_servers_and_racks_in_whole_numbers():
    d = api.cluster({"layout": "tp=8,pp=16"})
    assert d["spans"]["pp"]["groups"] == 8 and type(d["spans"]["pp"]["groups"]) is int
    assert (d["racks"], d["servers_per_rack"]) == (128 // 16, 16 // 8)
    assert type(d["racks"]) is int and type(d["servers_per_rack"]) is int
    assert (
        api.cluster({"layout": "tp=8,pp=16,dp=8192"})["world"] == api.MAX_ROW_GPUS
    )  # at the bound


def test_a_trace_is_a_json_file_whatever_sorts_beside_the_suffix(tmp_path):
    for name in ("a.html", "a.zip", "a.jsonl"):
        (tmp_path / name).write_text("[]")
        with pytest.raises(FourdError) as e:
            api.trace({"path": name}, trace_dir=tmp_path)
        assert str(e.value) == f"path={name!r}: a trace is a Chrome trace .json file"
    long = "d" * 90 + ".txt"
    with pytest.raises(FourdError) as e:
        api.trace({"path": long}, trace_dir=tmp_path)
    assert str(e.value) == f"path={long[:80]!r}: a trace is a Chrome trace .json file"


def test_the_plan_panel_reads_v_as_the_virtual_stages_and_nothing_else():
    q = {"model": "debug", "gpus": "8", "layout": "pp=2,dp=4", "schedule": "interleaved", "v": "2"}
    q |= {"microbatches": "8", "seq": "256", "global_batch_tokens": "8192", "zero": "1"}
    plan = api.plan(q)["plan"]
    assert (plan["virtual_stages"], plan["zero"]) == (2, 1)


def test_a_cluster_name_that_is_no_profile_name_is_shown_to_40_characters():
    name = "c" * 60 + ".toml"
    with pytest.raises(FourdError) as e:
        api.cluster({"layout": "tp=8", "cluster": name})
    assert str(e.value) == f"cluster={name[:40]!r}: give a cluster profile name such as llama3-h100"
