"""Software-stack profiles (fourd/plan/stacks/): the presets load, a bad file is one error line, `--stack`
reaches the plan and its JSON, and each switch changes exactly the term it names."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism
from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.perf import STRAGGLER_JITTER_S, layer_comm, ring_exposed, step_time
from fourd.plan.stack import load_stack, preset_names

H100 = load_cluster("dgx-h100")
L70 = get_preset("llama3-70b")
PAR = Parallelism(layout=Layout(tp=8, pp=1, dp=8), zero=1, sequence_parallel=True)


def _job(stack: str, **changes) -> Job:
    chosen = dataclasses.replace(load_stack(stack), **changes)
    return Job(model=L70, cluster=H100, par=PAR, seq=8192, global_seqs=64, stack=chosen)


def _plan(*args: str, home: str = "/nonexistent-fourd-home"):
    env = dict(os.environ, FOURD_HOME=home)
    command = [sys.executable, "-m", "fourd", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_the_seven_presets_load():
    names = {"fourd", "megatron-core", "megatron-lm", "deepspeed", "fsdp", "paddle", "jax-xla"}
    assert set(preset_names()) == names
    assert {load_stack(n).name for n in names} == names
    assert load_stack("megatron-core").tp_overlap == "ring"
    assert load_stack("megatron-lm").dp_overlap == "none"


@pytest.mark.parametrize(
    "text,message",
    [
        ('name = "x"\ntp_overlap = "always"\n', "tp_overlap = 'always'; choose one of none, ring"),
        ('name = "x"\ngemm_efficiency = 0.9\n', "unknown key(s) gemm_efficiency"),
        ("kernel_launch_us = -1\n", "kernel_launch_us = -1 must be a number >= 0"),
    ],
)
def test_a_bad_stack_file_is_one_error_line(tmp_path, text, message):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    done = _plan("--model", "llama3-8b", "--gpus", "8", "--stack", str(path))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("fourd: error: ")
    assert message in done.stderr
    with pytest.raises(FourdError, match="unknown stack 'megatron'"):
        load_stack("megatron")


def test_stack_reaches_the_json_and_the_report():
    args = ["--model", "llama3-8b", "--gpus", "8", "--layout", "tp=8", "--seq", "4096"]
    done = _plan(*args, "--stack", "megatron-core", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stack"] == "megatron-core"
    default = _plan(*args, "--json")
    assert json.loads(default.stdout)["stack"] == "fourd"
    report = _plan(*args, "--stack", "fsdp")
    assert "stack fsdp," in report.stdout.splitlines()[0]


def test_ring_overlap_leaves_one_chunk_or_what_the_gemm_cannot_cover():
    assert ring_exposed(8.0, 4.0, 8) == 4.5  # 8 − 4·7/8
    assert ring_exposed(8.0, 100.0, 8) == 1.0  # the first chunk of eight
    ring, plain = _job("megatron-core"), _job("megatron-core", tp_overlap="none")
    ring_fwd, ring_bwd, _, _ = layer_comm(ring.work)
    plain_fwd, plain_bwd, _, _ = layer_comm(plain.work)
    assert ring_fwd == pytest.approx(plain_fwd / 8) and ring_bwd == pytest.approx(plain_bwd / 8)
    assert step_time(ring).step_s < step_time(plain).step_s


def test_dp_overlap_none_exposes_all_data_parallel_traffic():
    hidden = step_time(_job("fsdp"))
    exposed = step_time(_job("fsdp", dp_overlap="none"))
    assert hidden.dp_exposed_s < hidden.dp_total_s
    assert exposed.dp_exposed_s == exposed.dp_total_s == hidden.dp_total_s


def test_cuda_graphs_remove_the_launch_gaps_and_fa3_speeds_attention():
    base = step_time(_job("fsdp")).step_s
    assert step_time(_job("fsdp", cuda_graphs=True)).step_s < base
    assert step_time(_job("fsdp", attention_kernel="fa3")).step_s < base


def test_flags_override_the_stack_and_fourd_on_a_cpu_profile_runs_eager(tmp_path):
    values = {"gpus": 8, "layout": "tp=8", "seq": 4096, "stack": "megatron-lm"}
    req = request.resolve(get_preset("llama3-8b"), H100, values)
    assert (req.base.attention, req.base.compiled, req.base.stack.name) == (
        "materialized",
        True,
        "megatron-lm",
    )
    pinned = request.resolve(
        get_preset("llama3-8b"), H100, values | {"attention": "flash", "compiled": "off"}
    )
    assert (pinned.base.attention, pinned.base.compiled) == ("flash", False)
    cpu = dataclasses.replace(H100, node=dataclasses.replace(H100.node, concurrent_ranks=2))
    assert request.resolve(get_preset("debug"), cpu, {"gpus": 2}).base.compiled is False


def test_a_step_waits_for_the_slowest_of_its_ranks():
    one = Job(model=L70, cluster=H100, par=Parallelism(layout=Layout()), seq=8192, global_seqs=1)
    assert step_time(one).straggler_s == 0.0
    many = step_time(_job("fsdp"))
    assert many.straggler_s == pytest.approx(STRAGGLER_JITTER_S * math.sqrt(2 * math.log(64)))
