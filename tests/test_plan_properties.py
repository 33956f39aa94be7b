"""Property tests (hypothesis) over the resolver, the planner and the simulators: any input, typed or text, ends
in a result or one FourdError of one line, never another exception."""

import contextlib
import io
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fourd.cli import main
from fourd.errors import FourdError
from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.cluster import load_cluster
from fourd.sim import faults
from fourd.sim.step import simulate_step

SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
H100 = load_cluster("dgx-h100")
TEXT = st.one_of(
    st.integers(-3, 70000).map(str),
    st.sampled_from(["", "nan", "inf", "-5T", "16M", "1e3", "x", "0", "2.5", "1K"]),
)
LAYOUT = st.builds(
    lambda d: ",".join(f"{k}={v}" for k, v in zip(("tp", "cp", "pp", "dp"), d) if v is not None),
    st.tuples(*[st.one_of(st.none(), st.integers(-1, 9)) for _ in range(4)]),
)
VALUES = st.fixed_dictionaries(
    {},
    optional={
        "gpus": st.one_of(TEXT, st.integers(-2, 512)),
        "layout": LAYOUT,
        "schedule": st.sampled_from(["gpipe", "1f1b", "interleaved", "zero-bubble", "2f2b"]),
        "microbatches": TEXT,
        "virtual_stages": st.integers(-1, 6),
        "seq": st.sampled_from([0, 1, 2, 64, 256, 1000, 1024, 2048]),
        "global_batch_tokens": TEXT,
        "recompute": st.sampled_from(["none", "selective", "per-op", "full", "all"]),
        "zero": st.one_of(st.integers(-1, 4), st.just("2")),
        "hsdp_replicas": st.integers(0, 4),
        "sequence_parallel": st.sampled_from(["on", "off", True, False, "yes"]),
        "compiled": st.sampled_from(["on", "off", "maybe"]),
        "attention": st.sampled_from(["flash", "materialized", "sparse"]),
        "precision": st.sampled_from(["bf16", "fp32", "fp8"]),
    },
)


def _one_line(e: FourdError) -> None:
    assert str(e) and "\n" not in str(e)


@SETTINGS
@given(model=st.sampled_from(["debug", "small", "llama3-8b"]), values=VALUES)
def test_any_request_plans_or_refuses_in_one_line(model, values):
    try:
        plans = request.plans(request.resolve(get_preset(model), H100, values))
    except FourdError as e:
        _one_line(e)
        return
    best = plans[0]
    assert best.step.step_s > 0 and math.isfinite(best.mfu) and best.memory.total > 0
    assert best.config.layout.world == best.gpus


@SETTINGS
@given(values=st.tuples(VALUES, st.integers(1, 64)).map(lambda t: {**t[0], "gpus": t[1]}))
def test_any_plan_simulates_or_refuses_in_one_line(values):
    try:
        plan = request.plans(request.resolve(get_preset("debug"), H100, values))[0]
        result = simulate_step(plan.job)
    except FourdError as e:
        _one_line(e)
        return
    assert result.step_time_s > 0 and all(0 <= f <= 1 for f in result.per_rank_idle_fraction)


@SETTINGS
@given(
    gpus=st.integers(-1, 1 << 20),
    days=st.one_of(st.floats(-1, 400), st.sampled_from([math.nan, math.inf, 1e9])),
    runs=st.integers(-1, 50),
    interval=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_any_fault_run_simulates_or_refuses_in_one_line(gpus, days, runs, interval):
    try:
        s = faults.summary(faults.simulate(gpus, days, runs, 0, interval))
    except FourdError as e:
        _one_line(e)
        return
    assert 0 <= s["effective_training_fraction"] <= 1


@pytest.mark.parametrize(
    "command", [["plan", "--model", "debug"], ["sim", "step", "--model", "debug"]]
)
@SETTINGS
@given(
    flags=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "--seq",
                    "--microbatches",
                    "--gpus",
                    "--top",
                    "--virtual-stages",
                    "--train-tokens",
                    "--global-batch-tokens",
                    "--zero",
                ]
            ),
            TEXT,
        ),
        min_size=1,
        max_size=3,
    )
)
def test_any_flags_answer_or_exit_2_with_one_line(command, flags):
    argv = [*command, "--json"] + [x for flag, value in flags for x in (flag, value)]
    if "--gpus" not in argv:
        argv += ["--gpus", "8"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = err.getvalue()
    assert (code, text) == (0, "") or (
        code == 2 and text.count("\n") == 1 and text.startswith("fourd: error: ")
    )
