"""Software-stack profiles (fourd.plan.stack): each switch changes exactly the term it names."""

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
from conftest import run_fourd

from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism
from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.block import traffic
from fourd.plan.cluster import (
    collective_latency,
    group_bandwidth,
    load_cluster,
    replica_group,
    shard_group,
)
from fourd.plan.job import Job
from fourd.plan.kernels import attention_time, collective_time, gemm_time
from fourd.plan.memory import max_rank_params, peak_memory, rank_memories
from fourd.plan.perf import (
    OVERLAP_SLOWDOWN,
    autocast_passes,
    layer_comm,
    layer_gemms,
    layer_time,
    p2p_time,
    sp_collectives,
    step_time,
)
from fourd.plan.report import plan_report
from fourd.plan.stack import load_stack, preset_names
from fourd.sim.step import simulate_step

H100 = load_cluster("dgx-h100")
L8B = get_preset("llama3-8b")
L70B = get_preset("llama3-70b")


@pytest.fixture
def user_stacks(tmp_path, monkeypatch):
    """$FOURD_HOME/stacks/ of a fresh home, with the profile cache cleared around the test."""
    monkeypatch.setenv("FOURD_HOME", str(tmp_path))
    (tmp_path / "stacks").mkdir()
    load_stack.cache_clear()
    yield tmp_path / "stacks"
    load_stack.cache_clear()


def job(layout, microbatches=8, sp=True, **fields):
    par = Parallelism(
        layout=layout,
        schedule="1f1b",
        microbatches=microbatches,
        zero=1,
        recompute="none",
        sequence_parallel=sp,
    )
    return Job(L8B, H100, par, 4096, layout.dp * microbatches, **fields)


def test_every_preset_loads_and_names_itself():
    names = preset_names()
    assert names == [
        "deepspeed",
        "fourd",
        "fsdp",
        "fsdp2",
        "internevo",
        "jax-xla",
        "lightning",
        "megatron-core",
        "megatron-lm",
        "nanotron",
        "nemo",
        "paddle",
    ]
    for name in names:
        stack = load_stack(name)
        assert stack.name == name and stack.description
    fourd, fsdp, fsdp2 = load_stack("fourd"), load_stack("fsdp"), load_stack("fsdp2")
    assert fsdp2 == dataclasses.replace(
        fsdp,
        name="fsdp2",
        description=fsdp2.description,
        sharding_copies=True,
        rank_order="tp-cp-dp-pp",
    )
    assert fourd == dataclasses.replace(
        fsdp2,
        name="fourd",
        description=fourd.description,
        zero=(0, 1, 2, 3),
        shared_kv=True,
        gather_in_step=(1,),
        rank_order="tp-cp-pp-dp",
    )
    # the pipeline outermost where the stack numbers its ranks so (Megatron's default order, DeepSpeed's
    # pipeline topology, torchtitan's mesh, nanotron's groups); data parallelism outermost elsewhere
    dp_inside = {name for name in names if load_stack(name).rank_order == "tp-cp-dp-pp"}
    assert dp_inside == {"deepspeed", "fsdp2", "megatron-core", "megatron-lm", "nanotron", "nemo"}
    nemo, core = load_stack("nemo"), load_stack("megatron-core")
    assert (nemo.fused_kernels, nemo.tp_overlap, nemo.dp_overlap) == (True, True, True)
    assert (core.fused_kernels, core.tp_overlap, core.dp_overlap) == (True, False, False)
    assert load_stack("deepspeed").pipeline_comm == "blocking"
    assert load_stack("megatron-lm").pipeline_comm == "synchronous"
    for name in ("megatron-core", "nemo"):
        assert load_stack(name).pipeline_comm == "interleaved-overlapped"
    autocast = {name: load_stack(name).autocast for name in names}
    assert autocast == {
        "deepspeed": "never",
        "fourd": "unwrapped",
        "fsdp": "unwrapped",
        "fsdp2": "unwrapped",
        "internevo": "never",
        "jax-xla": "unwrapped",
        "lightning": "always",
        "megatron-core": "never",
        "megatron-lm": "never",
        "nanotron": "never",
        "nemo": "never",
        "paddle": "never",
    }


def test_autocast_follows_the_stack_and_costs_its_casts_and_gradient_sums():
    """BF16 autocast over FP32 weights where the stack computes so: fourd on one replica only,
    Lightning's DDP on any, Megatron's BF16 weights never. Its passes, by hand: each microbatch
    casts every weight (6 B each) forward and its gradient back (6 B), and every microbatch after
    a step's first adds it into the FP32 gradient (12 B), at the profile's memory-bound rate."""
    one, replicas = Layout(1, 1, 1, 1), Layout(1, 1, 1, 4)
    assert job(one, sp=False).work.autocast and not job(replicas, sp=False).work.autocast
    for layout in (one, replicas):
        assert job(layout, sp=False, stack="lightning").work.autocast
        assert not job(layout, sp=False, stack="megatron-core").work.autocast
    lightning = job(one, microbatches=4, sp=False, stack="lightning")
    never = dataclasses.replace(
        lightning, stack="megatron-core", fused_kernels=False, fused_attention="flash2"
    )
    assert (
        dataclasses.replace(
            lightning.work, autocast=False, rank_order="tp-cp-dp-pp", selective="attention"
        )
        == never.work
    )
    params = max_rank_params(L8B, 1, 1, 1)
    passes = autocast_passes(lightning, params)
    rate = H100.gpu.hbm_bw_gbps * 0.9 * 1e9
    assert passes.forward_s == pytest.approx(6 * params / rate, rel=1e-12)
    assert passes.weight_grad_s == pytest.approx((6 + 12 * 3 / 4) * params / rate, rel=1e-12)
    assert passes.input_grad_s == 0.0
    full = dataclasses.replace(lightning, par=dataclasses.replace(lightning.par, recompute="full"))
    assert autocast_passes(full, params).input_grad_s == pytest.approx(6 * params / rate)
    # the weights and their gradients are FP32 under autocast: ZeRO 1 over 4 replicas shards the
    # optimizer's 8 B of moments, and each rank keeps 4 + 4 B whole
    ddp = job(replicas, sp=False, stack="lightning")
    memory = rank_memories(ddp, [0])[0]
    whole = max_rank_params(L8B, 1, 1, 1)
    assert (memory.params, memory.grads, memory.optimizer) == (4 * whole, 4 * whole, 2 * whole)
    # a pipeline's one autocast region around its schedule casts each weight once a step
    piped = job(Layout(1, 1, 2, 1), microbatches=4, sp=False, stack="lightning")
    assert autocast_passes(piped, params).forward_s == pytest.approx(6 * params / rate / 4)


def test_a_stacks_fused_kernels_are_compiles_fused_count():
    layout = Layout(2, 1, 1, 4)
    fused_job = job(layout, stack="megatron-core", dp_overlap=True, fused_attention="flash2")
    compiled_job, eager_job = job(layout, compiled=True), job(layout)
    # the same fused count; besides it fourd's attention reads the shared K/V heads of Llama 3's GQA
    # and Megatron's stack copies them, which costs time
    assert fused_job.work == dataclasses.replace(
        compiled_job.work, shared_kv=False, rank_order="tp-cp-dp-pp", selective="attention"
    )
    fused, compiled, eager = (step_time(j) for j in (fused_job, compiled_job, eager_job))
    assert compiled.compute_s < fused.compute_s < eager.compute_s
    # pinned for one plan either way, whatever the stack says
    assert step_time(job(layout, fused_kernels=True)).step_s == compiled.step_s
    unfused = job(
        layout,
        stack="megatron-core",
        dp_overlap=True,
        fused_kernels=False,
        fused_attention="flash2",
    )
    assert unfused.work == dataclasses.replace(
        eager_job.work, shared_kv=False, rank_order="tp-cp-dp-pp", selective="attention"
    )


def test_tp_overlap_exposes_the_first_chunk_of_each_chunked_collective():
    layout = Layout(8, 1, 1, 1)
    plain, overlapped = job(layout), job(layout, tp_overlap=True)
    assert overlapped.work.tp_overlap and not plain.work.tp_overlap
    tp_f, tp_b, _, _ = layer_comm(plain.work)
    gather, scatter = sp_collectives(plain.work)
    assert tp_f == 2 * (gather + scatter) and tp_b == 4 * gather + 2 * scatter
    fwd, dgrad, wgrad = layer_gemms(plain.work)
    assert tp_f < fwd and tp_b < dgrad + wgrad  # the GEMMs here outlast the collectives
    # Transformer Engine's defaults: forward all-gathers in 8 ring chunks, reduce-scatters in 4
    # pipelined splits; backward two all-gathers in ring chunks, the rest in bulk beside a GEMM
    want_f = 2 * gather / 8 + 2 * scatter / 4
    want_b = 2 * gather / 8
    got, base = layer_time(overlapped.work), layer_time(plain.work)
    assert got.forward_comm_s == pytest.approx(want_f, rel=1e-12)
    assert got.backward_comm_s == pytest.approx(want_b, rel=1e-12)
    # the hidden rest slows the GEMMs beside them by OVERLAP_SLOWDOWN
    assert got.forward_s == pytest.approx(base.forward_s + OVERLAP_SLOWDOWN * (tp_f - want_f))
    assert got.input_grad_s == pytest.approx(base.input_grad_s + OVERLAP_SLOWDOWN * (tp_b - want_b))
    # the step reports the exposed TP time: 8 microbatches of 32 layers
    step = step_time(overlapped)
    assert step.tp_comm_s == pytest.approx(8 * 32 * (want_f + want_b), rel=1e-12)


def test_tp_overlap_longer_than_its_gemms_leaves_the_excess_exposed():
    # TP over the NICs of one-GPU servers, a tiny model: communication outlasts the GEMMs
    slow = dataclasses.replace(H100, node=dataclasses.replace(H100.node, gpus=1))
    small = get_preset("small")
    par = Parallelism(layout=Layout(4, 1, 1, 1), microbatches=1, sequence_parallel=True)
    plain = Job(small, slow, par, 256, 1)
    over = dataclasses.replace(plain, tp_overlap=True)
    tp_f, _, _, _ = layer_comm(plain.work)
    gather, scatter = sp_collectives(plain.work)
    fwd, _, _ = layer_gemms(plain.work)
    assert tp_f > fwd
    first_chunks = 2 * gather / 4 + 2 * scatter / 4
    want = tp_f - fwd + fwd * first_chunks / tp_f
    assert layer_time(over.work).forward_comm_s == pytest.approx(want, rel=1e-12)


def test_tp_overlap_needs_sequence_parallelism():
    assert not job(Layout(8, 1, 1, 1), sp=False, tp_overlap=True).work.tp_overlap
    with pytest.raises(FourdError, match="TP overlap runs with sequence parallelism only"):
        request.resolve(
            L8B,
            H100,
            {"layout": "tp=8", "tp_overlap": "on", "sequence_parallel": "off", "seq": 4096},
        )


def test_without_dp_overlap_every_reduction_is_exposed():
    layout = Layout(2, 1, 1, 4)
    overlapped = step_time(job(layout, stack="megatron-core", dp_overlap=True))
    after = step_time(job(layout, stack="megatron-core"))
    assert overlapped.dp_exposed_s < overlapped.dp_total_s == after.dp_total_s == after.dp_exposed_s
    assert after.overlap_s == 0.0
    assert after.step_s == pytest.approx(
        overlapped.step_s - overlapped.dp_exposed_s - overlapped.overlap_s + after.dp_total_s
    )
    with pytest.raises(FourdError, match="overlaps data-parallel traffic with compute only"):
        simulate_step(job(layout, stack="megatron-core"))


def test_blocking_sends_need_a_pipeline():
    layout = Layout(1, 1, 1, 8)
    assert step_time(job(layout, pipeline_comm="blocking")) == step_time(job(layout))


# 70B on tp=8, pp=4, dp=2: interleaved, 5 stages per rank, 8 microbatches
INTERLEAVED = Parallelism(
    layout=Layout(8, 1, 4, 2),
    schedule="interleaved",
    microbatches=8,
    virtual_stages=5,
    sequence_parallel=True,
)


def test_interleaving_sends_cross_every_stage_boundary():
    par = INTERLEAVED
    interleaved = Job(L70B, H100, par, 4096, 16)
    assert step_time(interleaved).p2p_s == pytest.approx(2 * (4 * 5 - 1) * p2p_time(interleaved))
    plain = dataclasses.replace(
        interleaved, par=dataclasses.replace(par, schedule="1f1b", virtual_stages=1)
    )
    assert step_time(plain).p2p_s == pytest.approx(2 * (4 - 1) * p2p_time(plain))


def test_synchronous_sends_wait_for_each_microbatchs_exchanges():
    overlapped = Job(L70B, H100, INTERLEAVED, 4096, 16)
    synchronous = dataclasses.replace(overlapped, pipeline_comm="synchronous")
    one = p2p_time(overlapped)
    assert p2p_time(synchronous) == one  # with SP each TP rank sends its shard alike
    # warm-up and cool-down's 2(p·V − 1), and each later microbatch's two exchanges per stage
    want = (2 * (4 * 5 - 1) + 2 * 5 * (8 - 1)) * one
    assert step_time(synchronous).p2p_s == pytest.approx(want)
    assert step_time(synchronous).step_s == pytest.approx(
        step_time(overlapped).step_s + want - step_time(overlapped).p2p_s
    )
    planned = request.plans(
        request.resolve(
            L70B,
            H100,
            {
                "layout": "tp=8,pp=4,dp=2",
                "schedule": "interleaved",
                "virtual_stages": 5,
                "microbatches": 8,
                "global_seqs": 16,
                "seq": 4096,
                "stack": "megatron-core",
            },
        )
    )[0]
    # Megatron-LM's training loop overlaps the interleaved schedule's exchanges, and waits for 1F1B's
    assert planned.job.pipeline_comm == "interleaved-overlapped"
    assert planned.job.pipeline_sends == "overlapped"
    one_chunk = dataclasses.replace(
        planned.job, par=dataclasses.replace(planned.job.par, schedule="1f1b", virtual_stages=1)
    )
    assert one_chunk.pipeline_sends == "synchronous"


def test_a_user_stack_wins_and_bad_files_are_named(user_stacks):
    mine = user_stacks / "fourd.toml"
    mine.write_text('description = "mine"\nfused_kernels = true\n')
    assert load_stack("fourd").description == "mine" and load_stack("fourd").fused_kernels
    mine.write_text("fused_kernel = true\n")
    load_stack.cache_clear()
    with pytest.raises(FourdError, match=r"unknown stack key\(s\) fused_kernel"):
        load_stack("fourd")
    mine.write_text('tp_overlap = "yes"\n')
    load_stack.cache_clear()
    with pytest.raises(FourdError, match="tp_overlap must be a bool"):
        load_stack("fourd")
    with pytest.raises(FourdError, match="did you mean `nemo`"):
        load_stack("nemoo")


def _plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "fourd", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_names_the_stack_and_its_switches():
    common = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--layout", "tp=8,dp=4"]
    common += ["--seq", "4096", "--global-batch-tokens", str(32 * 4096), "--microbatches", "8"]
    done = _plan(*common, "--stack", "nemo", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["stack"], out["tp_overlap"], out["dp_overlap"], out["compiled"]) == (
        "nemo",
        True,
        True,
        False,
    )
    text = _plan(*common, "--stack", "megatron-core").stdout
    assert "fused kernels · stack megatron-core · cuDNN attention · DP after backward" in text
    assert "compile" not in text.split("chosen by the planner")[1].splitlines()[0]
    bad = _plan(*common, "--stack", "megatron")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("fourd: error: unknown stack 'megatron'")
    framework = _plan(*common, "--stack", "torchtitan")
    assert framework.returncode == 2 and framework.stdout == ""
    assert framework.stderr.startswith(
        "fourd: error: unknown stack 'torchtitan' (for torchtitan use --stack fsdp2): presets "
    )
    assert len(bad.stderr.splitlines()) == 1
    no_sp = _plan(*common, "--tp-overlap", "on", "--sequence-parallel", "off")
    assert (
        no_sp.returncode == 2 and "TP overlap runs with sequence parallelism only" in no_sp.stderr
    )


def test_gemm_time_of_the_layer_is_its_matmuls():
    work = job(Layout(2, 1, 1, 1)).work
    fwd, _, _ = layer_gemms(work)
    tokens = work.tokens
    shapes = [(4096 // 2, 4096), (1024 // 2, 4096), (1024 // 2, 4096), (4096, 4096 // 2)]
    shapes += [(14336 // 2, 4096), (14336 // 2, 4096), (4096, 14336 // 2)]
    assert fwd == pytest.approx(sum(gemm_time(tokens, n, k, H100, 2) for n, k in shapes))


def _searched(stack, gpus=64, **values):
    """Every candidate of an open search of Llama 3 70B on `gpus` H100 on `stack`."""
    values = {"gpus": gpus, "seq": 4096, "stack": stack} | values
    return request.plans(request.resolve(L70B, H100, values))


def test_an_open_search_keeps_to_the_schedules_and_zero_stages_the_stack_runs():
    for name in preset_names():
        stack = load_stack(name)
        tried = {
            (plan.config.schedule, plan.config.zero, plan.config.layout.pp > 1)
            for plan in _searched(name)
            if plan.config.layout.dp * plan.config.layout.cp > 1
        }
        piped = {(schedule, zero) for schedule, zero, pipelined in tried if pipelined}
        flat = {(schedule, zero) for schedule, zero, pipelined in tried if not pipelined}
        assert piped == {
            (schedule, zero)
            for schedule in stack.schedules
            if schedule != "gpipe" or stack.schedules == ("gpipe",)
            for zero in [stage for stage in stack.zero_stages(2) if stage > 0] or [0]
            if "pp" in stack.model_parallel
        }, name
        assert flat == {("1f1b", zero) for zero in [s for s in stack.zero if s > 0] or [0]}, name
    deepspeed = load_stack("deepspeed")
    assert deepspeed.schedules == ("1f1b",) and deepspeed.zero_stages(2) == (0, 1)
    assert deepspeed.zero_stages(1) == (0, 1, 2, 3)
    assert load_stack("megatron-core").schedules == ("1f1b", "interleaved")
    assert load_stack("megatron-core").zero == (0, 1)


def test_an_open_search_keeps_to_the_model_parallel_dimensions_the_stack_runs(user_stacks):
    """DDP (`lightning`) splits no model: an open search offers data parallelism alone; a profile
    with TP only offers no CP or PP; every other preset runs all three."""
    assert load_stack("lightning").model_parallel == ()
    assert {str(plan.config.layout) for plan in _searched("lightning")} == {"tp=1,cp=1,pp=1,dp=64"}
    (user_stacks / "mine.toml").write_text('model_parallel = ["tp"]\n')
    layouts = {plan.config.layout for plan in _searched("mine")}
    assert {lay.tp for lay in layouts} > {1} and {(lay.cp, lay.pp) for lay in layouts} == {(1, 1)}
    for name in preset_names():
        if name != "lightning":
            assert load_stack(name).model_parallel == ("tp", "cp", "pp"), name


def test_a_pinned_layout_beyond_the_stack_is_planned_with_one_note(capsys):
    values = {"layout": "tp=2,pp=2,dp=16", "seq": 4096, "stack": "lightning", "zero": 1}
    plan = request.plans(request.resolve(L70B, H100, values))[0]
    assert str(plan.config.layout) == "tp=2,cp=1,pp=2,dp=16"
    assert capsys.readouterr().err == (
        "fourd: note: the lightning stack runs data parallelism only, not tp=2, pp=2: planned as "
        "asked\n"
    )


def test_a_stack_that_runs_only_gpipe_and_no_sharding_is_searched_as_such(user_stacks):
    (user_stacks / "mine.toml").write_text('schedules = ["gpipe"]\nzero = [0]\n')
    tried = {(p.config.schedule, p.config.zero, p.config.layout.pp) for p in _searched("mine")}
    assert {(schedule, zero) for schedule, zero, pp in tried if pp > 1} == {("gpipe", 0)}
    assert {(schedule, zero) for schedule, zero, pp in tried if pp == 1} == {("1f1b", 0)}


def test_hsdp_left_open_is_zero_3_on_any_stack():
    plans = _searched("megatron-core", layout="tp=8,dp=8", hsdp_replicas=2)
    assert {plan.config.zero for plan in plans} == {3}


def test_a_pinned_setting_the_stack_does_not_run_is_planned_with_one_note(capsys):
    common = {"layout": "tp=8,pp=4,dp=2", "seq": 4096, "stack": "megatron-core"}
    plan = request.plans(request.resolve(L70B, H100, common | {"schedule": "zero-bubble"}))[0]
    assert plan.config.schedule == "zero-bubble"
    assert capsys.readouterr().err == (
        "fourd: note: the megatron-core stack runs the schedules 1f1b, interleaved, not "
        "zero-bubble: planned as asked\n"
    )
    deepspeed = common | {"stack": "deepspeed", "zero": 3}
    assert request.plans(request.resolve(L70B, H100, deepspeed))[0].config.zero == 3
    assert capsys.readouterr().err == (
        "fourd: note: the deepspeed stack runs ZeRO 0, 1 with pipeline parallelism, not ZeRO 3: "
        "planned as asked\n"
    )
    request.plans(request.resolve(L70B, H100, common | {"schedule": "interleaved", "zero": 1}))
    request.resolve(L70B, H100, {"gpus": 64, "seq": 4096, "stack": "deepspeed", "zero": 3})
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "line, named",
    [
        ('schedules = ["zb"]', "schedules = ['zb']"),
        ("zero = []", "zero = []"),
        ("zero = [true]", "zero = [True]"),
        ("pipeline_zero = [1, 1]", "pipeline_zero = [1, 1]"),
        ('schedules = "1f1b"', "schedules must be a list"),
        ("gather_in_step = [3]", "gather_in_step = [3]"),
        ("gather_in_step = [1, 1]", "gather_in_step = [1, 1]"),
        ('model_parallel = ["dp"]', "model_parallel = ['dp']"),
        ('model_parallel = ["tp", "tp"]', "model_parallel = ['tp', 'tp']"),
    ],
)
def test_a_stacks_bad_capability_list_is_named(user_stacks, line, named):
    (user_stacks / "mine.toml").write_text(line + "\n")
    with pytest.raises(FourdError, match=re.escape(named)):
        load_stack("mine")


def test_a_profile_names_only_what_differs_from_the_defaults(user_stacks):
    (user_stacks / "mine.toml").write_text('description = "only this"\n')
    mine = load_stack("mine")
    assert (mine.fused_kernels, mine.tp_overlap, mine.dp_overlap) == (False, False, True)
    assert (mine.shared_kv, mine.gather_in_step) == (False, ())
    assert (mine.pipeline_comm, mine.schedules, mine.zero, mine.pipeline_zero) == (
        "overlapped",
        ("gpipe", "1f1b", "interleaved", "zero-bubble"),
        (0, 1, 2, 3),
        (0, 1, 2, 3),
    )


def test_a_profile_by_path_from_here_and_unreadable_ones_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.toml").write_text('description = "by path"\nfused_kernels = true\n')
    assert load_stack("here.toml").fused_kernels and load_stack("here.toml").name == "here"
    with pytest.raises(FourdError, match=r"^stack profile gone\.toml not found: give an existing"):
        load_stack("gone.toml")
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(FourdError, match=r"binary\.toml: not a readable TOML stack profile"):
        load_stack("binary.toml")
    (tmp_path / "folder.toml").mkdir()
    with pytest.raises(FourdError, match=r"^stack profile folder\.toml not found"):
        load_stack("folder.toml")
    # a regular file that cannot be read, even by root: this process's memory, read from its start
    (tmp_path / "unreadable.toml").symlink_to("/proc/self/mem")
    with pytest.raises(FourdError, match=r"unreadable\.toml: not a readable TOML stack profile"):
        load_stack("unreadable.toml")
    load_stack.cache_clear()


def test_what_a_stack_lacks_is_said_with_and_without_a_pipeline():
    lm, deepspeed = load_stack("megatron-lm"), load_stack("deepspeed")
    assert (
        lm.lacks(1, schedule="zero-bubble") == ""
    )  # without a pipeline every schedule is the same
    assert (
        lm.lacks(2, schedule="zero-bubble")
        == "runs the schedules 1f1b, interleaved, not zero-bubble"
    )
    assert lm.lacks(1, zero=3) == "runs ZeRO 0, not ZeRO 3"
    assert deepspeed.lacks(1, zero=3) == ""
    assert deepspeed.lacks(2, zero=3) == "runs ZeRO 0, 1 with pipeline parallelism, not ZeRO 3"
    assert deepspeed.lacks(4, schedule="interleaved", zero=2) == (
        "runs the schedules 1f1b, not interleaved and runs ZeRO 0, 1 with pipeline parallelism, "
        "not ZeRO 2"
    )


def test_a_gather_inside_the_optimizer_step_is_exposed_whole(user_stacks):
    """ZeRO 1's weight all-gather beside the next forward hides all but its last bucket (one per
    layer) when the forward is longer; inside the optimizer's step (nanotron, DeepSpeed, fourd's
    ShardedAdamW) none of it hides: the step grows by the rest, less the slowdown it no longer
    causes."""
    (user_stacks / "inside.toml").write_text("gather_in_step = [1]\n")
    (user_stacks / "beside.toml").write_text("gather_in_step = []\n")
    layout = Layout(2, 1, 1, 4)
    inside, beside = (step_time(job(layout, stack=name)) for name in ("inside", "beside"))
    layers = L8B.layers
    params = max_rank_params(L8B, 1, 1, 2)
    gather = layers * collective_time("all_gather", 2 * params / layers, shard_group(layout), H100)
    assert gather < beside.per_microbatch.forward_s  # beside the forward, it would hide
    assert inside.dp_total_s == pytest.approx(beside.dp_total_s, rel=1e-12)
    more_exposed = gather - gather / layers
    assert inside.dp_exposed_s - beside.dp_exposed_s == pytest.approx(more_exposed, rel=1e-9)
    assert inside.step_s - beside.step_s == pytest.approx(
        more_exposed * (1 - OVERLAP_SLOWDOWN), rel=1e-9
    )
    assert [load_stack(name).gather_in_step for name in ("nanotron", "deepspeed", "fourd")] == [
        (1,),
        (1, 2),
        (1,),
    ]
    # ZeRO 3 gathers for every forward and backward: the switch leaves it alone
    zero3 = Parallelism(layout=layout, schedule="1f1b", microbatches=8, zero=3, recompute="none")
    assert step_time(Job(L8B, H100, zero3, 4096, 32, stack="inside")) == step_time(
        Job(L8B, H100, zero3, 4096, 32, stack="beside")
    )


def test_a_stacks_gradient_buckets_are_collective_calls_and_the_embeddings_are_exposed(user_stacks):
    """ZeRO 1 on 4 replicas of TP 2: the rank's gradients (FP32, 4 B a parameter) reduce-scattered
    in one call per layer (FSDP's units), or in one per 25 MiB of its BF16 gradients (torch DDP's
    bucket_cap_mb, nanotron's default): more calls, each its latency, the embedding's share of them
    exposed; the weights' gathers stay one per layer."""
    (user_stacks / "layers.toml").write_text("dp_bucket_mb = 0\n")
    (user_stacks / "ddp.toml").write_text("dp_bucket_mb = 25\n")
    layout = Layout(2, 1, 1, 4)
    per_layer, ddp = (job(layout, stack=name) for name in ("layers", "ddp"))
    params = max_rank_params(L8B, 1, 1, 2)
    buckets = math.ceil(params * 2 / (25 * 2**20))
    assert (per_layer.gradient_buckets(params, 32), ddp.gradient_buckets(params, 32)) == (
        32,
        buckets,
    )
    assert buckets == 307
    group = shard_group(layout)

    def reduced(calls):
        return calls * collective_time("reduce_scatter", 4 * params / calls, group, H100)

    gathered = 32 * collective_time("all_gather", 2 * params / 32, group, H100)
    assert step_time(ddp).dp_total_s == pytest.approx(reduced(buckets) + gathered, rel=1e-12)
    assert step_time(per_layer).dp_total_s == pytest.approx(reduced(32) + gathered, rel=1e-12)
    assert reduced(buckets) - reduced(32) == pytest.approx(
        (buckets - 32) * collective_latency("reduce_scatter", group, H100), rel=1e-9
    )  # the same bytes; each call its latency
    # both hide behind the last backward but the input embedding's gradients, which it computes
    # last: 6.5 % of the rank's, more than a layer's or a bucket's
    embedding = L8B.embedding_params() / 2 / params
    assert embedding > 1 / 32
    exposed = step_time(ddp).dp_exposed_s - step_time(per_layer).dp_exposed_s
    assert exposed == pytest.approx(embedding * (reduced(buckets) - reduced(32)), rel=1e-9)
    assert load_stack("nanotron").dp_bucket_mb == load_stack("lightning").dp_bucket_mb == 25
    assert load_stack("fourd").dp_bucket_mb == 0
    # under autocast the gradients are FP32: half as many parameters fill a bucket
    autocast = job(Layout(1, 1, 1, 4), sp=False, stack="lightning")
    assert autocast.gradient_buckets(1e9, 32) == math.ceil(4e9 / (25 * 2**20))


def test_the_report_says_how_nanotron_splits_its_pipeline_and_buckets_its_gradients():
    """nanotron's 1.34B shape on 2 pipeline ranks: the report gives the cost split (11 and 5 layers,
    the 131,072-word output layer 4.0 layers' worth), the 25 MiB buckets and the FP32 gradient sum's
    pass; `--json` the split."""
    spec = "layers=16,dim=2048,ffn=8192,heads=32,kv_heads=32,vocab=131072"
    common = ["--model-spec", spec, "--cluster", "dgx-h100", "--layout", "pp=2,dp=8", "--zero", "1"]
    common += ["--seq", "4096", "--global-batch-tokens", "1M"]
    text = _plan(*common, "--stack", "nanotron").stdout
    assert (
        "Stack nanotron splits the 16 layers over the pipeline by cost, the output layer weighing "
        "4.0 layers: 11, 5." in text
    )
    assert "Stack nanotron reduces the gradients in buckets of 25 MiB" in text
    assert (
        "Stack nanotron adds each microbatch's BF16 weight gradients into FP32 copies in a pass of "
        "their own: " in text
    )
    assert json.loads(_plan(*common, "--stack", "nanotron", "--json").stdout)["stage_layers"] == [
        11,
        5,
    ]
    fourd = _plan(*common).stdout
    assert "by cost" not in fourd and "buckets of" not in fourd and "pass of their own" not in fourd


@pytest.mark.parametrize("value", ["-1", "true", '"25"', "nan"])
def test_a_stacks_bad_gradient_bucket_is_one_line(user_stacks, value):
    (user_stacks / "mine.toml").write_text(f"dp_bucket_mb = {value}\n")
    with pytest.raises(FourdError, match=r"dp_bucket_mb = .*; give the MiB of a gradient bucket"):
        load_stack("mine")


def test_the_step_simulator_gathers_after_the_update_and_ends_when_the_weights_arrive(
    user_stacks,
):
    (user_stacks / "inside.toml").write_text("gather_in_step = [1]\n")
    (user_stacks / "beside.toml").write_text("gather_in_step = []\n")
    layout = Layout(2, 1, 2, 2)
    inside, beside = (simulate_step(job(layout, stack=name)) for name in ("inside", "beside"))
    for rank, events in enumerate(inside.events):
        gathers = [t for t in inside.transfers if t.kind == "ag" and t.rank == rank]
        reduced = max(t.end for t in inside.transfers if t.kind == "rs" and t.rank == rank)
        update_end = max(events[-1].end, reduced) + inside.optimizer_s[rank]
        assert len(gathers) == L8B.layers // 2  # one bucket per layer of the rank's stage
        assert min(t.start for t in gathers) == pytest.approx(update_end, rel=1e-12)
    last_gather = max(t.end for t in inside.transfers if t.kind == "ag")
    assert inside.step_time_s == pytest.approx(last_gather, rel=1e-12)
    assert inside.step_time_s > beside.step_time_s
    # beside the forward: the first gather starts with the step, before the first forward
    assert min(t.start for t in beside.transfers if t.kind == "ag") == 0


# ---- the fused attention kernel a stack runs ------------------------------------------------------


def test_the_attention_kernel_is_the_stacks_and_cudnn_runs_only_where_the_gpu_has_its_figures():
    assert [load_stack(name).fused_attention for name in ("nemo", "megatron-core", "jax-xla")] == [
        "cudnn"
    ] * 3
    others = ("fourd", "fsdp", "deepspeed", "megatron-lm", "nanotron", "paddle")
    assert {load_stack(name).fused_attention for name in others} == {"flash2"}
    layout = Layout(2, 1, 1, 4)
    assert job(layout, stack="nemo").work.fused_attention == "cudnn"
    assert job(layout, stack="fsdp").work.fused_attention == "flash2"
    # pinned for one plan either way
    assert job(layout, stack="nemo", fused_attention="flash2").work.fused_attention == "flash2"
    assert job(layout, fused_attention="cudnn").work.fused_attention == "cudnn"
    # an A100 profile has no cuDNN figures (Transformer Engine runs FlashAttention-2 there)
    a100 = dataclasses.replace(job(layout, stack="nemo"), cluster=load_cluster("selene-a100"))
    assert a100.work.fused_attention == "flash2"


def test_cudnn_attention_is_faster_by_exactly_its_efficiencies_and_nothing_else_moves():
    layout = Layout(2, 1, 1, 4)
    flash, cudnn = (job(layout, fused_attention=kernel).work for kernel in ("flash2", "cudnn"))
    gpu = H100.gpu
    # Llama 3 8B, a microbatch of one 4,096-token sequence, TP 2: 16 query heads of 128 on this rank
    pairs = 4096 * 4096 / 2
    flops = 4 * pairs * 128 * 16
    peak = 989e12 * 4096 / (4096 + 384)
    by_hand = {
        "flash2": (flops / (peak * 0.35), 2.5 * flops / (peak * 0.25)),
        "cudnn": (flops / (peak * 0.56), 2.5 * flops / (peak * 0.40)),
    }
    assert (gpu.attention_fwd_efficiency, gpu.attention_bwd_efficiency) == (0.35, 0.25)
    assert (gpu.cudnn_attention_fwd_efficiency, gpu.cudnn_attention_bwd_efficiency) == (0.56, 0.40)
    fast, slow = layer_time(cudnn), layer_time(flash)
    gain_f = by_hand["flash2"][0] - by_hand["cudnn"][0]
    gain_b = by_hand["flash2"][1] - by_hand["cudnn"][1]
    assert slow.forward_s - fast.forward_s == pytest.approx(gain_f, rel=1e-9)
    assert slow.input_grad_s - fast.input_grad_s == pytest.approx(gain_b, rel=1e-9)
    assert (slow.weight_grad_s, slow.forward_comm_s, slow.backward_comm_s) == (
        fast.weight_grad_s,
        fast.forward_comm_s,
        fast.backward_comm_s,
    )


def test_each_attention_kernel_runs_heads_of_64_at_its_measured_share_of_heads_of_128():
    """Shah et al. 2024, Fig. 5-6 (H100 SXM, 16k tokens): FlashAttention-2 299 and 291 TFLOP/s at head
    dim 64 against 335 and 322 at 128, cuDNN 388 and 433 against 539 and 516; log2-linear between."""
    a100 = load_cluster("dgx-a100-40gb")
    tokens, heads = 8192, 16
    pairs = tokens * tokens / 2
    cases = (
        (H100, "flash2", (0.35, 0.25), (299 / 335, 291 / 322)),
        (H100, "cudnn", (0.56, 0.40), (388 / 539, 433 / 516)),
        (a100, "cudnn", (0.68, 0.52), (299 / 335, 291 / 322)),  # no cuDNN figures: FlashAttention-2
    )
    for cluster, kernel, (fwd_eff, bwd_eff), (fwd_share, bwd_share) in cases:
        peak = cluster.gpu.peak_tflops * 1e12 * tokens / (tokens + 384)
        for head_dim, toward_128 in ((32, 0.0), (64, 0.0), (96, 0.5849625007211562), (128, 1.0)):
            fwd, bwd = attention_time(tokens, tokens, heads, head_dim, cluster, True, kernel)
            flops = 4 * pairs * head_dim * heads
            fwd_rate = peak * fwd_eff * (fwd_share + (1 - fwd_share) * toward_128)
            bwd_rate = peak * bwd_eff * (bwd_share + (1 - bwd_share) * toward_128)
            assert fwd == pytest.approx(flops / fwd_rate, rel=1e-12)
            assert bwd == pytest.approx(2.5 * flops / bwd_rate, rel=1e-12)
        wide = attention_time(tokens, tokens, heads, 256, cluster, True, kernel)
        narrow = attention_time(tokens, tokens, heads, 128, cluster, True, kernel)
        assert wide == pytest.approx((2 * narrow[0], 2 * narrow[1]), rel=1e-12)  # no gain above 128


def test_a_stacks_unknown_attention_kernel_is_one_line(user_stacks):
    (user_stacks / "mine.toml").write_text('fused_attention = "flash3"\n')
    with pytest.raises(FourdError, match=r"fused_attention = 'flash3'; allowed: flash2, cudnn"):
        load_stack("mine")


def test_a_stacks_unknown_autocast_mode_is_one_line_and_a_user_profile_sets_it(user_stacks):
    (user_stacks / "mine.toml").write_text('autocast = "sometimes"\n')
    with pytest.raises(
        FourdError, match=r"autocast = 'sometimes'; allowed: never, unwrapped, always"
    ):
        load_stack("mine")
    load_stack.cache_clear()
    (user_stacks / "mine.toml").write_text('autocast = "always"\n')
    assert job(Layout(1, 1, 1, 4), sp=False, stack="mine").work.autocast


def test_the_cli_names_the_attention_kernel_that_runs():
    common = ["--model", "llama3-8b", "--layout", "tp=8,dp=4", "--seq", "4096"]
    common += ["--global-batch-tokens", str(32 * 4096), "--microbatches", "8"]
    for cluster, stack, runs in (
        ("dgx-h100", "nemo", "cudnn"),
        ("selene-a100", "nemo", "flash2"),
        ("dgx-h100", "fsdp", "flash2"),
    ):
        done = _plan(*common, "--cluster", cluster, "--stack", stack, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["fused_attention"] == runs
    text = _plan(*common, "--cluster", "dgx-h100", "--fused-attention", "cudnn").stdout
    assert "stack fourd · cuDNN attention" in text
    flash = _plan(
        *common, "--cluster", "dgx-h100", "--stack", "nemo", "--fused-attention", "flash2"
    )
    assert flash.returncode == 0 and "cuDNN" not in flash.stdout
    bad = _plan(*common, "--fused-attention", "flash3")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1


def test_the_cli_says_when_a_plan_computes_by_autocast_and_plans_eager_attention():
    """`--stack lightning` on 8 GPUs computes by autocast over FP32 weights (the report says so and
    --json's `autocast` is true, with 4 + 4 B of FP32 weights and gradients a parameter); Megatron's
    stack does not; `--attention eager` is planned, slower than Megatron's fused softmax."""
    common = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--layout", "dp=8", "--seq", "2048"]
    common += ["--global-batch-tokens", str(64 * 2048), "--microbatches", "8", "--zero", "1"]
    lightning = _plan(*common, "--stack", "lightning", "--json")
    assert lightning.returncode == 0, lightning.stderr
    plan = json.loads(lightning.stdout)
    assert plan["autocast"] is True and plan["stack"] == "lightning"
    params = get_preset("llama3-8b").params()
    assert plan["memory_gb"]["params"] == pytest.approx(4 * params / 1e9, abs=5e-4)  # 3 decimals
    assert "autocast over FP32 weights" in _plan(*common, "--stack", "lightning").stdout
    megatron = json.loads(_plan(*common, "--stack", "megatron-core", "--json").stdout)
    assert megatron["autocast"] is False
    times = {}
    for attention in ("materialized", "eager"):
        done = _plan(*common, "--stack", "lightning", "--attention", attention, "--json")
        assert done.returncode == 0, done.stderr
        times[attention] = json.loads(done.stdout)["step_time_s"]
    assert times["eager"] > times["materialized"] > plan["step_time_s"]


def test_a_stack_reducing_bf16_gradients_moves_half_the_gradient_bytes(user_stacks):
    """grad_reduce = "bf16" (NeMo's performance recipes: grad_reduce_in_fp32 off): every gradient
    reduction moves 2 B a parameter where "fp32" moves 4 B; the weights' gather is unchanged, and
    FP32 training reduces FP32 gradients whatever the stack says."""
    (user_stacks / "fp32.toml").write_text('name = "fp32"\ndp_overlap = false\n')
    (user_stacks / "bf16.toml").write_text(
        'name = "bf16"\ndp_overlap = false\ngrad_reduce = "bf16"\n'
    )
    assert load_stack("fourd").grad_reduce == "fp32" and load_stack("nemo").grad_reduce == "bf16"
    fp32, bf16 = (job(Layout(dp=8), stack=name) for name in ("fp32", "bf16"))
    assert (fp32.grad_reduce_bytes, bf16.grad_reduce_bytes) == (4, 2)
    assert dataclasses.replace(bf16, precision="fp32").grad_reduce_bytes == 4
    plan = request.plans(request.resolve(L8B, H100, {"layout": Layout(dp=8), "stack": "nemo"}))[0]
    assert plan.to_json()["grad_reduce_bytes"] == 2
    params, group = max_rank_params(L8B, 1, 1, 1), shard_group(Layout(dp=8))
    layers = L8B.layers
    gather = layers * collective_time("all_gather", 2 * params / layers, group, H100)
    for stack_job, grad_bytes in ((fp32, 4), (bf16, 2)):
        scatter = layers * collective_time(
            "reduce_scatter", grad_bytes * params / layers, group, H100
        )
        # without DP overlap every collective of the step is exposed: ZeRO 1's scatter and gather
        step = step_time(stack_job)
        assert step.dp_total_s == pytest.approx(scatter + gather, rel=1e-12)
        assert step.dp_exposed_s == pytest.approx(scatter + gather, rel=1e-12)


def test_a_stack_file_with_an_unknown_gradient_precision_is_one_line_and_exit_2(tmp_path):
    stack = tmp_path / "mine.toml"
    stack.write_text('name = "mine"\ngrad_reduce = "fp16"\n')
    plan = ("plan", "--model", "debug", "--cluster", "dgx-h100", "--gpus", 8, "--stack", stack)
    code, out, err = run_fourd(*plan)
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"fourd: error: {stack}: grad_reduce = 'fp16'; allowed: fp32, bf16"]


def test_a_stack_holding_its_gradients_in_the_reduction_precision_is_read_and_checked(user_stacks):
    """main_grads = true (Megatron's main_grad buffer): a rank holds each gradient in the reduction's
    bytes, FP32 by default; a value that is not a bool is one line."""
    (user_stacks / "buffer.toml").write_text('name = "buffer"\nmain_grads = true\n')
    assert load_stack("buffer").main_grads and not load_stack("fourd").main_grads
    buffered, plain = (job(Layout(dp=8), stack=name) for name in ("buffer", "fsdp"))
    assert (buffered.grad_bytes, plain.grad_bytes) == (4, 2)
    (user_stacks / "bad.toml").write_text('name = "bad"\nmain_grads = "yes"\n')
    with pytest.raises(FourdError, match="main_grads must be a bool"):
        load_stack("bad")


def test_a_plan_whose_tensors_fit_only_without_the_allocators_cache_says_so():
    """nanotron's 80B on 4 nodes (TP 8, PP 4, ZeRO 0): 68.8 GB of tensors and runtime with its FP32
    gradient accumulators, 81.8 GB with the allocator's cache: it fits only if the allocator empties
    its cache, retrying allocations."""
    spec = "layers=80,dim=8192,ffn=28672,heads=64,kv_heads=64,vocab=131072"
    common = ["--model-spec", spec, "--cluster", "dgx-h100", "--layout", "tp=8,pp=4"]
    common += [
        "--schedule",
        "1f1b",
        "--microbatches",
        "256",
        "--seq",
        "4096",
        "--recompute",
        "none",
    ]
    common += ["--global-batch-tokens", str(256 * 4096)]
    lines = {}
    for stack in ("nanotron", "megatron-core"):
        done = _plan(*common, "--stack", stack)
        assert done.returncode == 0, done.stderr
        lines[stack] = next(line for line in done.stdout.splitlines() if "total of 80 GB" in line)
    assert lines["nanotron"].split(maxsplit=4)[4] == (
        "68.8  fits only by emptying the allocator's cache (retries slow the steps)"
    )
    assert lines["megatron-core"].split()[-2:] == [
        "60.6",
        "fits",
    ]  # 4 B gradients, 20 layers a rank


def test_a_hybrid_zero_all_reduces_the_gradients_and_broadcasts_each_ranks_shard(user_stacks):
    """shard_reduce = "all_reduce" and weight_gather = "broadcast" (InternEvo's Hybrid ZeRO): ZeRO 1's
    gradients all-reduced whole, one call a layer, and the updated weights broadcast one rank's shard
    at a time, 16 calls on 16 ranks; a ZeRO 0 job is unchanged; a bad value is one line, and the step
    simulator, which reduce-scatters and all-gathers, refuses the stack in one line."""
    (user_stacks / "plain.toml").write_text('name = "plain"\ndp_overlap = false\n')
    (user_stacks / "hybrid.toml").write_text(
        'name = "hybrid"\ndp_overlap = false\nshard_reduce = "all_reduce"\n'
        'weight_gather = "broadcast"\n'
    )
    layout, group = Layout(dp=16), shard_group(Layout(dp=16))
    params, layers = max_rank_params(L8B, 1, 1, 1), L8B.layers
    plain, hybrid = (job(layout, stack=name) for name in ("plain", "hybrid"))
    assert (hybrid.shard_reduce, hybrid.weight_gather) == ("all_reduce", "broadcast")
    reduce_scatter = layers * collective_time("reduce_scatter", 4 * params / layers, group, H100)
    all_gather = layers * collective_time("all_gather", 2 * params / layers, group, H100)
    all_reduce = layers * collective_time("all_reduce", 4 * params / layers, group, H100)
    broadcasts = 16 * collective_time("broadcast", 2 * params / 16, group, H100)
    assert step_time(plain).dp_total_s == pytest.approx(reduce_scatter + all_gather, rel=1e-12)
    assert step_time(hybrid).dp_total_s == pytest.approx(all_reduce + broadcasts, rel=1e-12)
    # 16 broadcasts, each over 16 ranks on 2 servers: 16 calls of 15 steps, one between servers
    one = collective_latency("broadcast", group, H100)
    assert one == pytest.approx((8.4 + 14.0 + 14 * 3.4) * 1e-6, rel=1e-12)
    assert broadcasts == pytest.approx(16 * one + 2 * params / group_bandwidth(group, H100)[0])
    zero0 = [
        dataclasses.replace(j, par=dataclasses.replace(j.par, zero=0)) for j in (plain, hybrid)
    ]
    assert step_time(zero0[0]).dp_total_s == step_time(zero0[1]).dp_total_s
    (user_stacks / "bad.toml").write_text('name = "bad"\nshard_reduce = "reduce"\n')
    with pytest.raises(
        FourdError, match="shard_reduce = 'reduce'; allowed: reduce_scatter, all_reduce"
    ):
        load_stack("bad")
    overlapped = (user_stacks / "hybrid.toml").read_text().replace("dp_overlap = false\n", "")
    (user_stacks / "hybrid.toml").write_text(overlapped)
    load_stack.cache_clear()
    with pytest.raises(FourdError, match="stack hybrid runs all_reduce and broadcast"):
        simulate_step(job(layout, stack="hybrid"))


def test_the_first_flashattention_runs_at_half_flashattention_2s_rate():
    """fused_attention = "flash1": FlashAttention at half FlashAttention-2's share of the peak (Dao
    2023: FlashAttention-2 about twice as fast), forward and backward, at any head dimension."""
    for head_dim in (64, 96, 128):
        flash2 = attention_time(4096, 4096, 32, head_dim, H100, True, "flash2")
        flash1 = attention_time(4096, 4096, 32, head_dim, H100, True, "flash1")
        assert flash1 == pytest.approx((2 * flash2[0], 2 * flash2[1]), rel=1e-12)
    assert load_stack("internevo").fused_attention == "flash1"


def test_flashattention_in_triton_runs_forward_at_1_over_1_4_and_backward_at_half():
    """fused_attention = "triton": FlashAttention in Triton at 1/1.4 of FlashAttention-2's forward
    time rate and 1/2 of its backward's (Dao 2023 §4.1: FlashAttention-2 1.3-1.5x faster forward,
    about 2x backward), at any head dimension; `fourd plan --fused-attention triton` reports the
    family and computes longer than with FlashAttention-2, everything else the same."""
    for head_dim in (64, 96, 128):
        flash2 = attention_time(4096, 4096, 32, head_dim, H100, True, "flash2")
        triton = attention_time(4096, 4096, 32, head_dim, H100, True, "triton")
        assert triton == pytest.approx((1.4 * flash2[0], 2 * flash2[1]), rel=1e-12)
    plan = "plan --model llama3-8b --cluster dgx-h100 --gpus 8 --layout tp=1,cp=1,pp=1,dp=8 --json"
    plans = {}
    for family in ("flash2", "triton"):
        code, out, err = run_fourd(*plan.split(), "--fused-attention", family)
        assert code == 0, err
        plans[family] = json.loads(out)
    assert plans["triton"]["fused_attention"] == "triton"
    assert plans["triton"]["breakdown_s"]["compute"] > plans["flash2"]["breakdown_s"]["compute"]
    assert plans["triton"]["breakdown_s"]["dp_total"] == plans["flash2"]["breakdown_s"]["dp_total"]


def test_the_report_says_how_a_hybrid_zero_reduces_and_gathers():
    """InternEvo's ZeRO 1 on 16 ranks: Why names the all-reduce and the 16 broadcasts; fourd's ZeRO 1
    names neither."""
    values = {"layout": Layout(dp=16), "zero": 1, "stack": "internevo"}
    plan = request.plans(request.resolve(L8B, H100, values))[0]
    lines = plan_report(plan, 1e9).splitlines()
    assert (
        "  - Stack internevo all-reduces the whole gradients, each rank keeping its shard's: twice "
        "the bytes of a reduce-scatter." in lines
    )
    assert (
        "  - Stack internevo broadcasts each rank's updated weights on its own: 16 broadcasts over "
        "16 ranks a step, each paying a ring's latency." in lines
    )
    plain = request.plans(request.resolve(L8B, H100, {**values, "stack": "fourd"}))[0]
    assert "broadcast" not in plan_report(
        plain, 1e9
    ) and "all-reduces the whole" not in plan_report(plain, 1e9)


def test_zero_1_within_replica_groups_reduces_in_each_group_and_across_them(user_stacks):
    """ZeRO 1 sharded within each of 2 groups of 8 ranks (HSDP replicas): the gradients
    reduce-scattered within a group, the shards all-reduced across the groups, the weights gathered
    within it, Adam's state over 8 ranks; with InternEvo's switches the whole gradients all-reduced
    over all 16 ranks and the shards broadcast within the group, 8 calls."""
    (user_stacks / "plain.toml").write_text('name = "plain"\ndp_overlap = false\n')
    (user_stacks / "hybrid.toml").write_text(
        'name = "hybrid"\ndp_overlap = false\nshard_reduce = "all_reduce"\n'
        'weight_gather = "broadcast"\n'
    )
    layout, layers = Layout(dp=16), L8B.layers
    params = max_rank_params(L8B, 1, 1, 1)
    shard, every = shard_group(layout, 2), shard_group(layout)
    replicas = replica_group(layout, 2)
    assert (shard.size, every.size, replicas.size) == (8, 16, 2)

    def grouped(name):
        base = job(layout, stack=name)
        return dataclasses.replace(base, par=dataclasses.replace(base.par, hsdp_replicas=2))

    plain, hybrid = grouped("plain"), grouped("hybrid")
    scatter = layers * collective_time("reduce_scatter", 4 * params / layers, shard, H100)
    across = layers * collective_time("all_reduce", 4 * params / 8 / layers, replicas, H100)
    gather = layers * collective_time("all_gather", 2 * params / layers, shard, H100)
    assert step_time(plain).dp_total_s == pytest.approx(scatter + across + gather, rel=1e-12)
    whole = layers * collective_time("all_reduce", 4 * params / layers, every, H100)
    broadcasts = 8 * collective_time("broadcast", 2 * params / 8, shard, H100)
    assert step_time(hybrid).dp_total_s == pytest.approx(whole + broadcasts, rel=1e-12)
    # Adam's 12 B a parameter over the 8 ranks of a group, not the 16
    assert peak_memory(plain)[1].optimizer == pytest.approx(
        peak_memory(job(layout, stack="plain"))[1].optimizer * 2, rel=1e-12
    )
    with pytest.raises(
        FourdError, match="runs HSDP with ZeRO 3 only, not 2 replica groups of ZeRO 1"
    ):
        simulate_step(grouped("fourd"))


def test_megatrons_selective_recomputation_runs_the_fused_attention_kernel_again(user_stacks):
    """Megatron-Core's selective recomputation (the megatron-core, megatron-lm and nemo presets:
    selective = "attention") checkpoints the core attention: beside a fused kernel its backward runs
    that kernel's forward again and keeps what no recomputation keeps; fourd's policy recomputes the
    elementwise ops instead. Llama 3 8B at 32,768 tokens, where attention is most of a layer."""
    layout = Layout(tp=2, dp=4)

    def work_of(stack: str, recompute: str):
        par = Parallelism(
            layout=layout,
            schedule="1f1b",
            microbatches=4,
            zero=1,
            recompute=recompute,
            sequence_parallel=True,
        )
        return Job(L8B, H100, par, 32768, 16, stack=stack).work

    none = work_of("megatron-core", "none")
    megatron = work_of("megatron-core", "selective")
    assert {name: load_stack(name).selective for name in preset_names()} == {
        name: "attention" if name in ("megatron-core", "megatron-lm", "nemo") else "elementwise"
        for name in preset_names()
    }
    assert megatron.recomputes_attention and not work_of("fourd", "selective").recomputes_attention
    heads = L8B.heads // layout.tp
    a_fwd, _ = attention_time(none.tokens, none.seq, heads, L8B.head_dim, H100, True, "cudnn")
    assert layer_time(megatron).backward == pytest.approx(
        layer_time(none).backward + a_fwd, rel=1e-12
    )
    assert layer_time(megatron).forward == layer_time(none).forward
    assert traffic(megatron) == traffic(none)  # it keeps what no recomputation keeps
    fourd = dataclasses.replace(megatron, selective="elementwise")
    assert traffic(fourd).saved < traffic(none).saved and traffic(fourd).redo > 0
    # the hardware FLOPs count the recomputed attention core: 4·L·H·Q·T a token more (Q·Kᵀ and P·V)
    given = {"layout": layout, "seq": 32768, "recompute": "selective", "stack": "megatron-core"}
    plan = request.plans(request.resolve(L8B, H100, given))[0]
    attention = 4 * L8B.layers * L8B.heads * L8B.head_dim * 32768
    assert plan.hw_tflops_per_gpu / plan.tflops_per_gpu == pytest.approx(
        1 + attention / L8B.flops_per_token(32768), rel=1e-12
    )
    # the report says what it costs: one attention forward a layer a microbatch, on all 32 layers
    again = 32 * plan.config.microbatches * a_fwd
    line = (
        "  - Stack megatron-core's selective recomputation runs each layer's fused attention kernel "
        f"again in its backward: {again:.3f} s per step ({100 * again / plan.step.step_s:.1f} %)."
    )
    assert line in plan_report(plan, 1e9).splitlines()
    elementwise = request.plans(request.resolve(L8B, H100, {**given, "stack": "fourd"}))[0]
    assert "fused attention kernel again" not in plan_report(elementwise, 1e9)
    (user_stacks / "bad.toml").write_text('name = "bad"\nselective = "mlp"\n')
    with pytest.raises(FourdError, match="selective = 'mlp'; allowed: elementwise, attention"):
        load_stack("bad")
