"""fourd.plan.anchor by hand, on a plan with every term at once (TP, CP and a pipeline): the split of a
step, what a measurement pins with and without a forward/backward time, the target it predicts, the
terms each side gives, the stack an anchor carries, and the simulated step it scales (contract:
`fourd plan --anchor`)."""

import dataclasses
import json
import math

import pytest

from fourd.errors import FourdError
from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.anchor import (
    Anchor,
    Pinned,
    anchor_sim,
    chip,
    load_anchor,
    own_plan,
    pin,
    predict,
    split,
    terms,
)
from fourd.plan.cluster import load_cluster
from fourd.plan.memory import GB
from fourd.plan.search import evaluate

MODEL = get_preset("llama3-8b")
H100 = load_cluster("dgx-h100")
# two of everything: TP and CP collectives in the compute, a 1F1B bubble, DP traffic
VALUES = {
    "layout": "tp=2,cp=2,pp=2,dp=2",
    "schedule": "1f1b",
    "microbatches": 4,
    "seq": 8192,
    "global_batch_tokens": 8 * 8192,
    "zero": 1,
    "recompute": "none",
    "sequence_parallel": True,
    "stack": "nemo",
}


def _plan(**changes):
    return request.plans(request.resolve(MODEL, H100, VALUES | changes))[0]


@pytest.fixture(scope="module")
def plan():
    found = _plan()
    assert found.step.tp_comm_s > 0 and found.step.cp_comm_s > 0 and found.step.bubble_s > 0
    return found


def _anchor(step_s, fb_s=None, memory_gb=None):
    return Anchor(
        path="a.json",
        model=MODEL,
        cluster=H100,
        values=dict(VALUES),
        step_time_s=step_s,
        peak_memory_gb=memory_gb,
        forward_backward_s=fb_s,
        stack="nemo",
    )


def test_a_step_splits_into_local_work_and_the_models_scale_out(plan):
    times = plan.step
    parts = split(plan)
    compute = times.compute_s - times.tp_comm_s - times.cp_comm_s
    assert parts.compute == pytest.approx(compute, rel=1e-12)
    assert parts.bubble == pytest.approx(times.bubble_s * compute / times.compute_s, rel=1e-12)
    assert parts.optimizer == times.optimizer_s
    assert parts.scale_out == pytest.approx(
        times.step_s - parts.compute - parts.bubble - times.optimizer_s, rel=1e-12
    )
    assert parts.local == pytest.approx(parts.compute + parts.bubble + parts.optimizer, rel=1e-12)
    # a step without compute has no compute-bound bubble either
    idle = dataclasses.replace(
        plan, step=dataclasses.replace(times, compute_s=0.0, tp_comm_s=0.0, cp_comm_s=0.0)
    )
    assert (split(idle).compute, split(idle).bubble) == (0.0, 0.0)


def test_a_forward_backward_time_pins_the_rate_and_the_per_step_cost(plan):
    times, parts, m = plan.step, split(plan), plan.config.microbatches
    comm = (times.tp_comm_s + times.cp_comm_s) / m
    fb = 1.5 * parts.compute / m + comm  # the microbatch 1.5 × the model's time
    pinned = pin(_anchor(2.0 * times.step_s, fb_s=fb), plan)
    assert pinned.rate == pytest.approx(1.5, rel=1e-12)
    want = 2.0 * times.step_s - 1.5 * (parts.compute + parts.bubble) - parts.scale_out
    assert pinned.step_cost_s == pytest.approx(want, rel=1e-12)
    assert (pinned.anchor_optimizer_s, pinned.modelled_s) == (times.optimizer_s, times.step_s)
    # microbatches measured alone slower than the whole step allows: no negative per-step cost
    assert pin(_anchor(times.step_s, fb_s=3 * fb), plan).step_cost_s == 0.0


def test_the_measured_step_alone_pins_one_rate_and_the_memory_the_model_misses(plan):
    parts = split(plan)
    pinned = pin(_anchor(plan.step.step_s + parts.local, memory_gb=plan.peak_gb + 3.0), plan)
    assert pinned.rate == pytest.approx(2.0, rel=1e-12)
    assert pinned.step_cost_s is None
    assert pinned.memory_overhead_gb == pytest.approx(3.0, rel=1e-9)
    with pytest.raises(FourdError, match="shorter than the planner's modelled communication"):
        pin(_anchor(parts.scale_out), plan)


def test_a_target_takes_the_pinned_rate_and_keeps_its_own_scale_out(plan):
    target = _plan(layout="tp=2,cp=2,pp=2,dp=4", global_batch_tokens=16 * 8192)
    parts, times = split(target), target.step
    pinned = Pinned(
        rate=1.25,
        step_cost_s=None,
        anchor_optimizer_s=plan.step.optimizer_s,
        memory_overhead_gb=2.0,
        measured_s=1.0,
        modelled_s=1.0,
    )
    got = predict(target, pinned)
    compute = 1.25 * parts.compute
    assert got.step.step_s == pytest.approx(
        compute + 1.25 * parts.bubble + 1.25 * parts.optimizer + parts.scale_out, rel=1e-12
    )
    assert got.step.compute_s == pytest.approx(
        compute + times.tp_comm_s + times.cp_comm_s, rel=1e-12
    )
    assert got.step.bubble_s == pytest.approx(
        1.25 * parts.bubble + times.bubble_s - parts.bubble, rel=1e-12
    )
    assert got.step.optimizer_s == pytest.approx(1.25 * parts.optimizer, rel=1e-12)
    assert got.memory.reserve == pytest.approx(target.memory.reserve + 2.0 * GB, rel=1e-12)
    # a per-step cost measured at the anchor follows the optimizer's work: twice the shards, half
    costed = predict(target, dataclasses.replace(pinned, step_cost_s=0.3))
    ratio = parts.optimizer / plan.step.optimizer_s
    assert ratio == pytest.approx(0.5, rel=1e-9)
    assert costed.step.optimizer_s == pytest.approx(0.3 * ratio, rel=1e-12)
    # an anchor without optimizer work of its own carries the cost as it is
    flat = predict(target, dataclasses.replace(pinned, step_cost_s=0.3, anchor_optimizer_s=0.0))
    assert flat.step.optimizer_s == 0.3
    # without a memory measurement the model's memory stands
    bare = predict(target, dataclasses.replace(pinned, memory_overhead_gb=None))
    assert bare.memory == target.memory


def test_which_terms_come_from_the_anchor_and_which_from_the_model():
    base = Pinned(1.0, None, 1.0, None, 1.0, 1.0)
    modelled = ["tp_comm", "cp_comm", "bubble (communication part)", "p2p", "dp_exposed", "overlap"]
    local = ["compute", "bubble (compute-bound part)"]
    assert terms(base) == ([*local, "optimizer"], [*modelled, "memory"])
    costed = dataclasses.replace(base, step_cost_s=0.1, memory_overhead_gb=1.0)
    assert terms(costed) == (
        [*local, "optimizer and per-step cost", "memory overhead"],
        [*modelled, "memory (tensors)"],
    )


def test_an_anchor_on_a_known_stack_is_planned_on_it_and_other_stacks_are_refused(tmp_path, capsys):
    from fourd.cli import main

    path = tmp_path / "anchor.json"
    own = _plan()
    data = {"model": "llama3-8b", "cluster": "dgx-h100", "gpus": 16, "step_time_s": 1.2}
    path.write_text(json.dumps(data | VALUES))
    anchor = load_anchor(path)
    assert anchor.stack == "nemo" and own_plan(anchor).job.stack == "nemo"
    assert own_plan(anchor).step.step_s == own.step.step_s
    assert main(["plan", "--anchor", str(path), "--stack", "nemo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stack"] == "nemo"
    for other in ("deepspeed", "paddle"):  # before and after "nemo" in order
        assert main(["plan", "--anchor", str(path), "--stack", other]) == 2
        assert f"--stack {other} differs from the anchor's stack nemo" in capsys.readouterr().err
    # --search with an anchor: the best is the first candidate, judged on anchored intervals
    assert main(["plan", "--anchor", str(path), "--search", "--top", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"] == out["candidates"][0]
    assert out["best"]["step_time_s"] <= out["candidates"][1]["step_time_s"]


def test_a_models_bad_fields_are_named_up_to_80_characters(tmp_path):
    path = tmp_path / "anchor.json"
    fields = {"layers": 2, "not_a_field_" + "x" * 100: 1}
    data = {"model": fields, "cluster": "dgx-h100", "gpus": 8, "step_time_s": 1.0}
    path.write_text(json.dumps(data | VALUES))
    with pytest.raises(FourdError) as refused:
        load_anchor(path)
    assert f"model {str(fields)[:80]}: " in str(refused.value)
    assert f"model {str(fields)[:81]}" not in str(refused.value)


@pytest.mark.parametrize("value", [0, 0.0, -1.0, True, "1"])
def test_a_step_time_must_be_a_positive_number(tmp_path, value):
    path = tmp_path / "anchor.json"
    path.write_text(
        json.dumps(
            {"model": "llama3-8b", "cluster": "dgx-h100", "gpus": 16}
            | VALUES
            | {"step_time_s": value}
        )
    )
    with pytest.raises(FourdError, match=r"step_time_s = .* must be a positive number \(seconds\)"):
        load_anchor(path)


def test_a_chip_is_its_gpus_first_word_or_the_profiles_name():
    assert chip(H100) == "H100"
    nameless = dataclasses.replace(H100, gpu=dataclasses.replace(H100.gpu, name=""))
    assert chip(nameless) == H100.name


def test_the_simulated_step_is_carried_by_the_anchored_planners_ratio(plan):
    anchored = predict(plan, Pinned(1.5, None, plan.step.optimizer_s, None, 1.0, 1.0))
    modelled = evaluate(plan.job).step.step_s
    out = {"step_time_s": 0.8, "tokens_per_s": 1000.0, "tflops_per_gpu": 300.0, "mfu": 0.3}
    got = anchor_sim(out, anchored)
    step = 0.8 * anchored.step.step_s / modelled
    factor = 0.8 / step
    assert got == {
        "step_time_s": pytest.approx(step, rel=1e-12),
        "unanchored_step_time_s": 0.8,
        "tokens_per_s": pytest.approx(1000.0 * factor, rel=1e-12),
        "tflops_per_gpu": pytest.approx(300.0 * factor, rel=1e-12),
        "mfu": pytest.approx(0.3 * factor, rel=1e-12),
        "anchored": True,
    }
    assert factor < 1  # a slower stack: fewer tokens, a lower MFU


def _file(tmp_path, name="anchor.json", **changes):
    path = tmp_path / name
    data = {"model": "llama3-8b", "cluster": "dgx-h100", "gpus": 16, "step_time_s": 1.2} | VALUES
    path.write_text(json.dumps({k: v for k, v in (data | changes).items() if v is not None}))
    return path


def test_an_anchored_plan_carries_the_anchored_intervals_and_the_flags_given(tmp_path, capsys):
    from fourd.cli import main
    from fourd.plan import intervals

    path = _file(tmp_path)
    assert main(["plan", "--anchor", str(path), "--model", "llama3-8b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # NeMo's rows are grouped with Megatron-Core's and Megatron-LM's (one code base)
    assert intervals.stack_family("nemo") == "megatron"
    # the anchor's own configuration: the anchor's shape, at the spread's floor
    assert (out["interval_shape"], out["interval_spread"]) == (
        intervals.SAME,
        pytest.approx(intervals.SPREAD_FLOOR, abs=1e-12),
    )
    group = intervals.lookup(
        list(intervals.table()[1]), "time", True, "H100", "megatron", "cluster", intervals.SAME
    )
    assert group is not None and group.anchored
    width = group.half_width * out["interval_spread"]
    low, high = out["step_time_s_interval"]
    assert low == pytest.approx(out["step_time_s"] * math.exp(-width), rel=1e-12)
    assert high == pytest.approx(out["step_time_s"] * math.exp(width), rel=1e-12)
    # a flag the target gives wins over the anchor's setting, whatever its name sorts as
    assert main(["plan", "--anchor", str(path), "--compile", "on", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compiled"] is True
    assert main(["plan", "--anchor", str(path)]) == 0
    text = capsys.readouterr().out
    assert "Intervals (80 %, from the validation suite's anchored out-of-sample rows)" in text
    assert f"{low:.4g} s .. {high:.4g} s" in text


def test_an_anchors_model_and_chip_are_the_targets(tmp_path, capsys):
    from fourd.cli import main

    both = _file(tmp_path, "both.json", model_spec="layers=2,dim=256,ffn=512,heads=4,vocab=1000")
    neither = _file(tmp_path, "neither.json", model=None)
    for path in (both, neither):
        with pytest.raises(FourdError, match="give one of model .* and model_spec"):
            load_anchor(path)
    spec = _file(
        tmp_path, "spec.json", model=None, model_spec="layers=2,dim=256,ffn=512,heads=4,vocab=1000"
    )
    assert load_anchor(spec).model.layers == 2
    with pytest.raises(FourdError, match=r"^anchor .*llama9\.json: unknown model"):
        load_anchor(_file(tmp_path, "llama9.json", model="llama9"))
    with pytest.raises(FourdError, match=r"^anchor .*nowhere\.json: .*cluster"):
        load_anchor(_file(tmp_path, "nowhere.json", cluster="no-such-cluster"))
    # an A100 anchor pins an A100's rate: an H100 profile is refused, as an A100 one is for an H100
    a100 = _file(tmp_path, "a100.json", cluster="dgx-a100-40gb")
    assert main(["plan", "--anchor", str(a100), "--cluster", "dgx-h100"]) == 2
    assert "an anchor pins one GPU's rate" in capsys.readouterr().err
    assert main(["plan", "--anchor", str(_file(tmp_path)), "--cluster", "dgx-a100-40gb"]) == 2
    assert "an anchor pins one GPU's rate" in capsys.readouterr().err


def test_an_open_target_is_its_best_plan_and_a_search_lists_the_anchored_candidates(
    tmp_path, capsys
):
    from fourd.cli import main

    path = str(_file(tmp_path))
    # 32 GPUs, the layout left open: the plan is the search's best
    assert main(["plan", "--anchor", path, "--gpus", "32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(["plan", "--anchor", path, "--gpus", "32", "--search", "--json", "--top", "3"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["searched"] > 1 and plan["layout"] == found["best"]["layout"]
    assert plan["step_time_s"] == found["best"]["step_time_s"]
    assert main(["plan", "--anchor", path, "--gpus", "32"]) == 0
    text = capsys.readouterr().out
    best = ",".join(f"{k}={v}" for k, v in plan["layout"].items())
    assert text.startswith("fourd plan: 32 × ") and f"  {best} · " in text
    assert "Step-time intervals of the candidates" not in text
    assert f"  step time      {plan['step_time_s']:>10.4g} s     " in text  # the best's interval
    assert main(["plan", "--anchor", path, "--gpus", "32", "--search", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "Step-time intervals of the candidates (80 %), in the order above" in text
    for rank, candidate in enumerate(found["candidates"], 1):
        low, high = candidate["step_time_s_interval"]  # the anchored intervals
        assert f"{rank:>3}. " in text and f"{low:.4g} s .. {high:.4g} s" in text
    # a search on a layout alone plans that layout's GPUs, not the anchor's 16
    layout = "tp=2,cp=2,pp=2,dp=4"
    assert main(["plan", "--anchor", path, "--layout", layout, "--search", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["gpus"] == 32
