"""`fourd plan --anchor FILE` and `fourd sim step --anchor FILE`: a measured step reproduced exactly, a second
configuration predicted by the documented formula from the unanchored plans' own breakdowns, the refusals
and a real `fourd train` run's anchor.json read back."""

import json

import pytest
from conftest import run_fourd
from test_train_auto import LOCAL as LOCAL_CPU

from fourd.cli import main

ANCHOR = {
    "model": "llama3-405b",
    "cluster": "llama3-h100",
    "gpus": 8192,
    "layout": "tp=8,cp=1,pp=16,dp=64",
    "schedule": "interleaved",
    "virtual_stages": 8,
    "microbatches": 32,
    "seq": 8192,
    "global_batch_tokens": 16777216,
    "recompute": "none",
    "zero": 1,
    "sequence_parallel": True,
    "stack": "meta-llama3",
    "step_time_s": 12.504,  # Llama 3 Table 4, row 1 (430 TFLOP/s per GPU)
    "peak_memory_gb": 70.0,
    "an_unknown_key": "ignored",
}
# The same run's settings as `fourd plan` flags, without the anchor.
OWN = [
    "--model=llama3-405b",
    "--cluster=llama3-h100",
    "--gpus=8192",
    "--layout=tp=8,cp=1,pp=16,dp=64",
    "--schedule=interleaved",
    "--virtual-stages=8",
    "--microbatches=32",
    "--seq=8192",
    "--global-batch-tokens=16777216",
    "--recompute=none",
    "--zero=1",
    "--sequence-parallel=on",
]
TARGET = ["--gpus=16384", "--layout=tp=8,pp=16,dp=128", "--microbatches=16", "--virtual-stages=8"]


def write(tmp_path, name="anchor.json", **changes):
    data = {k: v for k, v in (ANCHOR | changes).items() if v is not None}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def fourd_json(capsys, *argv) -> dict:
    assert main(list(map(str, argv))) == 0
    return json.loads(capsys.readouterr().out)


def refusal(capsys, *argv) -> str:
    assert main(list(map(str, argv))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    return err[0]


def local_terms(plan: dict) -> tuple[float, float]:
    """(local, scale-out) seconds of an unanchored `fourd plan --json`, by fourd.plan.anchor.split's rule."""
    b = plan["breakdown_s"]
    compute = b["compute"] - b["tp_comm"] - b["cp_comm"]
    local = compute + b["bubble"] * compute / b["compute"] + b["optimizer"]
    return local, plan["step_time_s"] - local


def test_the_anchors_own_configuration_is_its_measurement(tmp_path, capsys):
    out = fourd_json(capsys, "plan", "--anchor", write(tmp_path), "--json")
    assert out["step_time_s"] == pytest.approx(12.504, rel=1e-12)
    assert out["peak_memory_gb"] == pytest.approx(70.0, rel=1e-12)
    assert out["layout"] == {"tp": 8, "cp": 1, "pp": 16, "dp": 64} and out["microbatches"] == 32
    assert out["anchor"]["measured_step_time_s"] == 12.504
    assert out["anchored_terms"] == [
        "compute",
        "bubble (compute-bound part)",
        "optimizer",
        "memory overhead",
    ]
    assert "dp_exposed" in out["modelled_terms"] and "tp_comm" in out["modelled_terms"]
    low, high = out["step_time_s_interval"]
    assert low < 12.504 < high


def test_a_second_configuration_follows_the_documented_formula(tmp_path, capsys):
    own = fourd_json(capsys, "plan", *OWN, "--json")
    target = fourd_json(capsys, "plan", *OWN[:2], *OWN[4:], *TARGET, "--json")
    local_a, out_a = local_terms(own)
    local_t, out_t = local_terms(target)
    rate = (12.504 - out_a) / local_a  # the stack's rate against the model
    got = fourd_json(capsys, "plan", "--anchor", write(tmp_path), *TARGET, "--json")
    assert got["anchor"]["compute_rate_ratio"] == pytest.approx(rate, rel=1e-9)
    assert got["step_time_s"] == pytest.approx(rate * local_t + out_t, rel=1e-9)
    assert got["unanchored_step_time_s"] == pytest.approx(target["step_time_s"], rel=1e-12)
    assert got["breakdown_s"]["dp_exposed"] == target["breakdown_s"]["dp_exposed"]  # modelled
    overhead = 70.0 - own["peak_memory_gb"]
    assert got["peak_memory_gb"] == pytest.approx(target["peak_memory_gb"] + overhead, rel=1e-9)


def test_a_forward_backward_time_pins_the_microbatch_and_the_per_step_cost(tmp_path, capsys):
    own = fourd_json(capsys, "plan", *OWN, "--json")
    b, m = own["breakdown_s"], 32
    compute = b["compute"] - b["tp_comm"] - b["cp_comm"]
    bubble = b["bubble"] * compute / b["compute"]
    scale_out = own["step_time_s"] - compute - bubble - b["optimizer"]
    fb = 0.3
    rate = (fb - (b["tp_comm"] + b["cp_comm"]) / m) / (compute / m)
    cost = 12.504 - rate * (compute + bubble) - scale_out
    got = fourd_json(capsys, "plan", "--anchor", write(tmp_path, forward_backward_s=fb), "--json")
    assert got["step_time_s"] == pytest.approx(12.504, rel=1e-12)
    assert got["anchor"]["compute_rate_ratio"] == pytest.approx(rate, rel=1e-9)
    assert got["anchor"]["per_step_cost_s"] == pytest.approx(cost, rel=1e-9)
    assert "optimizer and per-step cost" in got["anchored_terms"]


def test_the_text_report_names_where_each_term_came_from(tmp_path, capsys):
    got = fourd_json(capsys, "plan", "--anchor", write(tmp_path), *TARGET, "--json")
    alone, anchored = got["unanchored_step_time_s"], got["step_time_s"]
    assert main(["plan", "--anchor", str(write(tmp_path)), *TARGET]) == 0
    text = capsys.readouterr().out
    assert (
        f"  the model alone gives the first plan {alone:.4g} s per step; the anchor moves it "
        f"{100 * (anchored / alone - 1):+.1f} %" in text
    )
    assert "Intervals (80 %, from the validation suite's anchored out-of-sample rows)" in text
    assert "measured 12.5 s per step" in text
    assert (
        "  from the anchor: compute, bubble (compute-bound part), optimizer, memory overhead"
        in text
    )
    assert "  from the model: tp_comm, cp_comm, bubble (communication part), p2p" in text


def test_a_target_pipeline_runs_as_the_anchor_ran(tmp_path, capsys):
    """A target layout with a pipeline takes the anchor's schedule, and its virtual stages where the
    depth is the anchor's, when the flags leave them open (the planner's fastest here is V = 8, the
    anchor ran V = 2); a flag wins, and a layout without a pipeline takes neither."""
    path = write(tmp_path, virtual_stages=2)
    target = ["plan", "--anchor", path, "--gpus=16384"]
    same = fourd_json(capsys, *target, "--layout=tp=8,pp=16,dp=128", "--json")
    assert (same["schedule"], same["virtual_stages"]) == ("interleaved", 2)
    assert same["anchor"]["settings_from_anchor"][-2:] == ["schedule", "virtual_stages"]
    flags = ["--schedule=interleaved", "--virtual-stages=2", "--json"]
    pinned = fourd_json(capsys, *target, "--layout=tp=8,pp=16,dp=128", *flags)
    assert pinned["step_time_s"] == same["step_time_s"]
    assert "virtual_stages" not in pinned["anchor"]["settings_from_anchor"]
    mine = fourd_json(capsys, *target, "--layout=tp=8,pp=16,dp=128", "--virtual-stages=8", "--json")
    assert mine["virtual_stages"] == 8 and mine["step_time_s"] < same["step_time_s"]
    other_depth = fourd_json(capsys, *target, "--layout=tp=8,pp=8,dp=256", "--json")
    assert other_depth["schedule"] == "interleaved" and other_depth["virtual_stages"] != 2
    assert other_depth["anchor"]["settings_from_anchor"][-1] == "schedule"
    flat = fourd_json(capsys, *target, "--layout=tp=8,dp=2048", "--json")
    assert flat["schedule"] == "1f1b"
    assert not {"schedule", "virtual_stages"} & set(flat["anchor"]["settings_from_anchor"])
    assert main(list(map(str, [*target, "--layout=tp=8,pp=16,dp=128"]))) == 0
    text = capsys.readouterr().out
    taken = "seq, global_batch_tokens, recompute, zero, sequence_parallel, schedule, virtual_stages"
    assert f"  settings as the anchor ran: {taken}\n" in text


def test_an_anchor_without_virtual_stages_passes_on_the_ones_it_was_planned_at(tmp_path, capsys):
    """An interleaved anchor that leaves V open is planned at the planner's fastest for its own 32
    microbatches (V = 8); a target of the same depth runs that V, not the V = 2 the model ranks first at
    16 microbatches, so its bubble scales from the pipeline the anchor's rate was pinned on."""
    path = write(tmp_path, virtual_stages=None)
    own = fourd_json(capsys, "plan", "--anchor", path, "--json")
    layout = "--layout=tp=8,pp=16,dp=128"
    alone = fourd_json(
        capsys, "plan", *OWN[:2], *OWN[4:5], *OWN[7:], "--gpus=16384", layout, "--json"
    )
    target = fourd_json(capsys, "plan", "--anchor", path, "--gpus=16384", layout, "--json")
    assert (own["virtual_stages"], alone["virtual_stages"], target["virtual_stages"]) == (8, 2, 8)
    assert target["anchor"]["settings_from_anchor"][-2:] == ["schedule", "virtual_stages"]


def test_an_anchor_more_than_twice_off_the_model_is_flagged(tmp_path, capsys):
    """Llama 3's 12.5 s step runs at about 1 × the model's time: not flagged; the same step measured 3 ×
    slower, or 3 × faster, is, in the report and in --json."""
    assert main(["plan", "--anchor", str(write(tmp_path))]) == 0
    assert "times off the model" not in capsys.readouterr().out
    own = fourd_json(capsys, "plan", "--anchor", write(tmp_path), "--json")
    assert own["anchor"]["far_from_model"] is False
    for factor in (3.0, 1 / 3):
        path = write(tmp_path, step_time_s=ANCHOR["step_time_s"] * factor)
        assert main(["plan", "--anchor", str(path)]) == 0
        assert (
            "  that is more than 2 times off the model: check the measurement (memory pressure, a "
            "slow kernel, the layout it names); the prediction carries all of it to the target"
            in capsys.readouterr().out
        ), factor
        far = fourd_json(capsys, "plan", "--anchor", path, "--json")["anchor"]
        assert far["far_from_model"] is True
        assert not 0.5 <= far["compute_rate_ratio"] <= 2.0


def test_sim_step_carries_the_anchor(tmp_path, capsys):
    out = fourd_json(capsys, "sim", "step", "--anchor", write(tmp_path), "--json")
    assert out["anchored"] is True
    # the simulated step on the anchor's rate: times the anchored planner's step over the modelled one
    modelled = fourd_json(capsys, "plan", *OWN, "--json")["step_time_s"]
    assert out["step_time_s"] == pytest.approx(
        out["unanchored_step_time_s"] * 12.504 / modelled, rel=1e-9
    )


REFUSALS = {
    "missing": (
        {"seq": None, "step_time_s": None},
        [],
        "anchor {f}: missing required key(s) seq, step_time_s",
    ),
    "bad value": ({"zero": 7}, [], "anchor {f}: zero '7': choose one of 0, 1, 2, 3"),
    "negative time": (
        {"step_time_s": -1},
        [],
        "anchor {f}: step_time_s = -1 must be a positive number (seconds)",
    ),
    "too short": (
        {"step_time_s": 0.01},
        [],
        "anchor {f}: step_time_s = 0.01 s is shorter than the planner's modelled communication",
    ),
    "model": (
        {},
        ["--model", "llama3-70b"],
        "the model asked differs from the anchor's ({f}): an anchor pins one model's rate",
    ),
    "cluster": (
        {},
        ["--cluster", "selene-a100"],
        "cluster selene-a100 has A100 SXM 80GB GPUs but the anchor ({f}) ran on H100 SXM 80GB",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_anchors_are_refused_in_one_line(tmp_path, capsys, case):
    changes, flags, line = REFUSALS[case]
    path = write(tmp_path, **changes)
    got = refusal(capsys, "plan", "--anchor", path, *flags)
    assert got.startswith("fourd: error: " + line.format(f=path))


def test_a_file_that_is_not_an_anchor_is_refused(tmp_path, capsys):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{oops")
    assert refusal(capsys, "plan", "--anchor", tmp_path / "list.json") == (
        f"fourd: error: anchor {tmp_path / 'list.json'}: must be one JSON object "
        "(keys as `fourd plan --json` writes them)"
    )
    assert refusal(capsys, "plan", "--anchor", tmp_path / "bad.json").startswith(
        f"fourd: error: anchor {tmp_path / 'bad.json'}: is not JSON"
    )
    assert refusal(capsys, "plan", "--anchor", tmp_path / "none.json") == (
        f"fourd: error: anchor {tmp_path / 'none.json'}: cannot be read (No such file or "
        "directory): give the anchor.json of a run"
    )


@pytest.mark.slow
def test_a_training_run_leaves_an_anchor_that_plans_its_own_step(tmp_path):
    home, run = tmp_path / "home", tmp_path / "run"
    (home / "clusters").mkdir(parents=True)
    (home / "clusters" / "local.toml").write_text(LOCAL_CPU)  # a 2-core CPU profile
    from fourd.config import fourd_home

    env = {"FOURD_HOME": str(home)}
    cache = f"--data.cache_dir={fourd_home() / 'cache'}"
    code, _, err = run_fourd(
        "train", "--model", "debug", "--steps", 3, "--run-dir", run, cache, env=env
    )
    assert code == 0, err
    anchor = json.loads((run / "anchor.json").read_text())
    assert anchor["cluster"] == "local" and anchor["stack"] == "fourd"
    assert anchor["layout"] == "tp=1,cp=1,pp=1,dp=1" and anchor["gpus"] == 1
    assert anchor["seq"] == 256 and anchor["global_batch_tokens"] == 16 * 256
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert anchor["step_time_s"] == rows[-1]["step_time_s"]  # the median of the one step kept
    code, out, err = run_fourd("plan", "--anchor", run / "anchor.json", "--json", env=env)
    assert code == 0, err
    got = json.loads(out)
    assert got["step_time_s"] == pytest.approx(anchor["step_time_s"], rel=0.03)
    code, out, err = run_fourd(
        "plan", "--anchor", run / "anchor.json", "--layout", "dp=2", "--json", env=env
    )
    assert code == 0, err
    assert json.loads(out)["layout"]["dp"] == 2


def test_search_from_an_anchor_ranks_the_anchored_candidates(tmp_path, capsys):
    out = fourd_json(capsys, "plan", "--anchor", write(tmp_path), "--search", "--top=3", "--json")
    assert out["best"]["gpus"] == 8192 and out["searched"] > 100  # every layout of its GPU count
    times = [c["step_time_s"] for c in out["candidates"]]
    assert times == sorted(times)
    a, b = (
        out["candidates"][0]["step_time_s_interval"],
        out["candidates"][1]["step_time_s_interval"],
    )
    assert out["too_close_to_call"] == (a[0] <= b[1] and b[0] <= a[1])


def test_an_anchor_far_from_the_model_reorders_the_search_and_judges_it_on_anchored_intervals(
    tmp_path, capsys, monkeypatch
):
    """A measured step 4× the model's: compute counts four times over, the collectives do not, so the
    candidates' order is the anchored one (not the planner's own), and "too close to call" reads the
    anchored intervals: here a hair wide (±1e-6) where the unanchored ones span ×/÷ 10."""
    from fourd.plan import intervals

    wide = intervals.Group("time", False, "*", "*", "*", rows=8, half_width=2.302585)
    narrow = [
        intervals.Group("time", True, "*", "*", "*", rows=8, half_width=1e-6, shape=shape)
        for shape in (intervals.SAME, intervals.RESHAPED)
    ]
    monkeypatch.setattr(intervals, "table", lambda: (0.8, (wide, *narrow)))
    slow = write(tmp_path, step_time_s=4 * ANCHOR["step_time_s"])
    out = fourd_json(capsys, "plan", "--anchor", slow, "--search", "--top=6", "--json")
    times = [c["step_time_s"] for c in out["candidates"]]
    assert times == sorted(times) and times[0] < times[1]
    unanchored = fourd_json(capsys, "plan", *OWN[:3], "--search", "--top=6", "--json")
    mine = [c["layout"] for c in out["candidates"]]
    assert mine != [c["layout"] for c in unanchored["candidates"]]  # anchoring reorders them here
    a, b = (c["step_time_s_interval"] for c in out["candidates"][:2])
    assert b[0] - a[1] > 0  # the two best anchored intervals do not overlap
    assert out["too_close_to_call"] is False
