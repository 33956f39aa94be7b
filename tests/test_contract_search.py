"""The planner's search (fourd.plan.search) on cases worked out by hand: which layouts it enumerates, which
configurations it tries for each, and the hardware FLOPs and bubble share it reports of a plan.

Written from the survivors of `make mutation-pure MODULES=fourd/plan/search.py` (2026-12-05): each test
names the rule it holds; docs/testing.md lists the survivors and which test kills each."""

from __future__ import annotations

import dataclasses

import pytest

from fourd.layout import Layout, Parallelism
from fourd.model.config import parse_model_spec
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.search import MICRO_SEQS, _virtual_stages, configs, evaluate, layouts, search
from fourd.plan.stack import load_stack

H100 = load_cluster("dgx-h100")
# 4 layers of 4 heads of 64: TP may be 1, 2 or 4 (whole heads, FFN and vocabulary on each rank)
SMALL = parse_model_spec("layers=4,dim=256,ffn=1024,heads=4,kv_heads=4,vocab=1024")
OPEN = {
    "layout": None,
    "schedule": None,
    "virtual_stages": None,
    "microbatches": None,
    "zero": None,
    "recompute": None,
    "sequence_parallel": True,
    "hsdp_replicas": 1,
}


def _as_tuples(found: list[Layout]) -> set[tuple[int, int, int, int]]:
    return {(lay.tp, lay.cp, lay.pp, lay.dp) for lay in found}


def test_the_layouts_of_8_gpus_by_hand():
    """tp from {1, 2, 4} (4 heads), cp such that each rank keeps at least 1,024 of the 4,096 tokens in
    two equal chunks (1, 2, 4), pp such that every stage has a layer (1, 2, 4), dp the rest; every
    product is 8 and dp divides the 8 sequences."""
    want = {
        (1, 1, 1, 8),
        (1, 1, 2, 4),
        (1, 1, 4, 2),
        (1, 2, 1, 4),
        (1, 2, 2, 2),
        (1, 2, 4, 1),
        (1, 4, 1, 2),
        (1, 4, 2, 1),
        (2, 1, 1, 4),
        (2, 1, 2, 2),
        (2, 1, 4, 1),
        (2, 2, 1, 2),
        (2, 2, 2, 1),
        (2, 4, 1, 1),
        (4, 1, 1, 2),
        (4, 1, 2, 1),
        (4, 2, 1, 1),
    }
    assert _as_tuples(layouts(SMALL, 8, 4096, 8)) == want


def test_context_parallelism_is_tried_down_to_1024_tokens_a_rank_and_never_below():
    # 4,096 tokens: CP 4 leaves exactly 1,024 a rank (tried), CP 8 leaves 512 (not)
    cps = {lay.cp for lay in layouts(SMALL, 16, 4096, 16)}
    assert cps == {1, 2, 4}
    # a sequence shorter than 1,024 tokens still runs without CP
    assert {lay.cp for lay in layouts(SMALL, 8, 512, 8)} == {1}
    # CP cuts a sequence into 2·CP equal chunks: 4,100 tokens take CP 2 (4 chunks of 1,025), not CP 4
    assert {lay.cp for lay in layouts(SMALL, 8, 4100, 8)} == {1, 2}


def test_batch_that_no_replica_count_divides_leaves_those_layouts_out():
    # 6 sequences on 8 GPUs: dp 1 and 2 divide them, dp 4 and 8 do not
    assert {lay.dp for lay in layouts(SMALL, 8, 4096, 6)} == {1, 2}


def test_sequence_parallelism_skips_layouts_whose_sequence_tp_does_not_divide():
    """With SP each TP rank holds seq/cp/tp tokens between the blocks: 1,030 tokens split over TP 2 (515
    each) but not over TP 4; without SP every TP degree stays."""
    stack = load_stack("fourd")
    with_sp = {par.layout.tp for par in configs(SMALL, 4, 1030, 4, OPEN, stack)}
    without = {
        par.layout.tp
        for par in configs(SMALL, 4, 1030, 4, OPEN | {"sequence_parallel": False}, stack)
    }
    assert (with_sp, without) == ({1, 2}, {1, 2, 4})


def test_an_unsharded_layout_tries_zero_0_only_and_a_sharded_one_the_stacks_sharded_stages():
    stack = load_stack("fourd")
    by_layout: dict[tuple, set[int]] = {}
    for par in configs(SMALL, 4, 4096, 8, OPEN, stack):
        by_layout.setdefault((par.layout.cp, par.layout.dp), set()).add(par.zero)
    assert by_layout[(1, 1)] == {0}  # one replica, no CP: nothing to shard over
    assert by_layout[(1, 4)] == {1, 2, 3}
    assert by_layout[(2, 2)] == {1, 2, 3}  # CP ranks shard too (FSDP over dp x cp)
    fsdp = load_stack("fsdp")  # runs ZeRO 0, 2 and 3
    assert {par.zero for par in configs(SMALL, 4, 4096, 8, OPEN, fsdp) if par.layout.dp == 4} == {
        2,
        3,
    }


def test_only_interleaved_schedules_get_virtual_stages():
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(1, 1, 2, 2), "virtual_stages": 2}
    got = {(par.schedule, par.virtual_stages) for par in configs(SMALL, 4, 4096, 8, pinned, stack)}
    # pinned V 2 on a 4-layer, 2-stage pipeline: interleaved with 2, the others with 1
    assert got == {("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1)}
    opened = OPEN | {"layout": Layout(1, 1, 2, 2), "schedule": "interleaved"}
    stages = {par.virtual_stages for par in configs(SMALL, 4, 4096, 8, opened, stack)}
    # V 2: 4 chunks of a layer; V 3: 6 chunks, the first and last holding only the embedding and the
    # output (layers + 2 chunks); V 4 and more leave a chunk empty; V 1 is 1F1B, not interleaving
    assert stages == {2, 3}


def test_microbatch_sizes_tried_are_1_2_4_8_and_16_sequences():
    assert MICRO_SEQS == (1, 2, 4, 8, 16)
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(1, 1, 1, 1), "schedule": "1f1b", "zero": 0}
    counts = {par.microbatches for par in configs(SMALL, 1, 4096, 48, pinned, stack)}
    # 48 sequences a replica: 48, 24, 12, 6 and 3 microbatches
    assert counts == {48, 24, 12, 6, 3}


def test_hsdp_alone_still_checks_each_layout():
    """HSDP is the one setting besides the open ones that rules layouts out: with 2 replica groups a
    layout needs an even number of data-parallel ranks, so the search keeps to those."""
    base = Job(SMALL, H100, Parallelism(layout=Layout()), 4096, 8)
    plans = search(base, 4, OPEN | {"hsdp_replicas": 2})
    # every layout of 4 GPUs whose 2 or 4 replicas split into 2 groups, and no other
    assert _as_tuples([plan.config.layout for plan in plans]) == {
        (1, 1, 1, 4),
        (1, 1, 2, 2),
        (1, 2, 1, 2),
        (2, 1, 1, 2),
    }
    assert {plan.config.zero for plan in plans} == {3}


def _plan(recompute: str, attention: str = "flash", tp: int = 2):
    par = Parallelism(
        layout=Layout(tp, 1, 1, 1),
        schedule="1f1b",
        microbatches=1,
        zero=0,
        recompute=recompute,
        sequence_parallel=True,
    )
    return evaluate(Job(SMALL, H100, par, 4096, 1, attention=attention))


def _linear_flops_per_token() -> float:
    """Forward FLOPs of one layer's linear layers per token, the whole layer (every TP rank): Q, K, V, O
    and the SwiGLU's three matrices."""
    h, f = 256, 1024
    return 2 * (4 * h * h + 3 * h * f)


def test_full_recomputation_adds_the_whole_forward_to_the_hardware_flops():
    layers, heads, head_dim, seq = 4, 4, 64, 4096
    attention = 4 * layers * heads * head_dim * seq  # Q·Kᵀ and P·V forward, per token
    redone = layers * _linear_flops_per_token() + attention
    for tp in (1, 2):
        plan = _plan("full", tp=tp)
        per_token = SMALL.flops_per_token(seq)
        assert plan.hw_tflops_per_gpu == pytest.approx(
            plan.tflops_per_gpu * (1 + redone / per_token), rel=1e-12
        )
        # MFU counts the model's FLOPs alone, whatever is recomputed
        assert plan.mfu == plan.tflops_per_gpu / H100.gpu.peak_tflops
    # the scores in memory change nothing here: full redoes the attention core once either way
    materialized = _plan("full", attention="materialized")
    assert materialized.hw_tflops_per_gpu == pytest.approx(
        materialized.tflops_per_gpu * (1 + redone / SMALL.flops_per_token(seq)), rel=1e-12
    )


def test_per_op_and_selective_recomputation_in_the_hardware_flops_on_two_tp_ranks():
    h, f, layers, seq = 256, 1024, 4, 4096
    # per-op redoes every other matmul of wq, wk, wv, wo, w1, w3, w2: wk, wo and w3
    per_op = layers * 2 * (h * h + h * h + h * f)
    plan = _plan("per-op")
    assert plan.hw_tflops_per_gpu == pytest.approx(
        plan.tflops_per_gpu * (1 + per_op / SMALL.flops_per_token(seq)), rel=1e-12
    )
    # selective redoes no matmul; with the scores in memory it redoes the attention core
    flash = _plan("selective")
    assert flash.hw_tflops_per_gpu == flash.tflops_per_gpu
    materialized = _plan("selective", attention="materialized")
    core = 4 * layers * 4 * 64 * seq
    assert materialized.hw_tflops_per_gpu == pytest.approx(
        materialized.tflops_per_gpu * (1 + core / SMALL.flops_per_token(seq)), rel=1e-12
    )


def test_the_bubble_share_is_the_bubble_over_the_step():
    par = Parallelism(
        layout=Layout(1, 1, 4, 1), schedule="1f1b", microbatches=4, zero=0, recompute="none"
    )
    plan = evaluate(Job(SMALL, H100, par, 4096, 4))
    assert 0 < plan.step.bubble_s < plan.step.step_s
    assert plan.bubble_fraction == plan.step.bubble_s / plan.step.step_s


def test_virtual_stage_counts_split_the_layers_evenly_or_with_lighter_edges():
    # 4 layers on 2 ranks: V 2 (4 chunks of 1), V 3 (6 chunks, the edges holding no layer)
    assert _virtual_stages(4, 2) == [2, 3]
    # 6 layers on 2 ranks: V 2 (4 chunks: 1, 2, 2, 1), V 3 (6 of 1), V 4 (8 chunks, empty edges)
    assert _virtual_stages(6, 2) == [2, 3, 4]
    assert _virtual_stages(2, 2) == [2]  # 4 chunks: the two layers inside, the edges' empty
    assert _virtual_stages(1, 2) == []
    # 4 layers on 3 ranks: V 2 (6 chunks, the edges holding only the embedding and the output)
    assert _virtual_stages(4, 3) == [2]


def test_every_layout_spans_exactly_the_gpus_asked_for():
    # a long sequence lets CP go to 16; every degree divides what is left of the 16 GPUs
    found = layouts(SMALL, 16, 65536, 16)
    assert found and all(lay.tp * lay.cp * lay.pp * lay.dp == 16 for lay in found)
    assert {lay.cp for lay in found} == {1, 2, 4, 8, 16}
    assert {lay.pp for lay in found} == {1, 2, 4}  # 8 and 16 stages would leave stages empty
    # a batch of 240 sequences, which almost every replica count divides, on 12 and 16 GPUs
    for gpus in (12, 16):
        found = layouts(SMALL, gpus, 65536, 240)
        assert all(lay.tp * lay.cp * lay.pp * lay.dp == gpus for lay in found), gpus


def test_an_odd_replica_count_and_context_ranks_alone_are_sharded_too():
    """dp = 3; then cp = 3 with dp = 1: three ranks hold the same weights, so ZeRO shards over them."""
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(1, 1, 1, 3), "schedule": "1f1b"}
    assert {par.zero for par in configs(SMALL, 3, 4096, 6, pinned, stack)} == {1, 2, 3}
    pinned = OPEN | {"layout": Layout(1, 3, 1, 1), "schedule": "1f1b"}
    assert {par.zero for par in configs(SMALL, 3, 3078, 1, pinned, stack)} == {1, 2, 3}


def test_pinned_microbatches_that_do_not_divide_a_replicas_batch_leave_the_layout_out():
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(1, 1, 1, 2), "microbatches": 3}
    assert list(configs(SMALL, 2, 4096, 8, pinned, stack)) == []  # 4 sequences a replica
    assert {par.microbatches for par in configs(SMALL, 2, 4096, 12, pinned, stack)} == {3}


def test_interleaving_pinned_without_a_pipeline_runs_one_stage_a_rank():
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(1, 1, 1, 2), "schedule": "interleaved"}
    assert {par.virtual_stages for par in configs(SMALL, 2, 4096, 8, pinned, stack)} == {1}


def test_a_plans_rates_and_peak_memory_by_hand():
    par = Parallelism(
        layout=Layout(1, 1, 2, 1), schedule="1f1b", microbatches=3, zero=0, recompute="none"
    )
    plan = evaluate(Job(SMALL, H100, par, 4096, 3))
    step = plan.step.step_s
    assert plan.tokens_per_s == 3 * 4096 / step
    assert plan.tflops_per_gpu == 3 * 4096 * SMALL.flops_per_token(4096) / step / 2 / 1e12
    assert plan.memory.reserve == 2.0e9  # the profile's 2 GB for the CUDA context and NCCL
    assert plan.peak_gb == (plan.memory.total + plan.memory.reserve) / 1e9


def test_interleaving_tries_no_fewer_microbatches_than_ranks_when_it_has_enough():
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(1, 1, 2, 1), "schedule": "interleaved"}
    # 8 sequences a replica: 8, 4, 2 or 1 microbatches; one microbatch on 2 ranks would idle them
    got = {par.microbatches for par in configs(SMALL, 2, 4096, 8, pinned, stack)}
    assert got == {8, 4, 2}
    # 1 sequence: one microbatch is all there is, so it stays
    assert {par.microbatches for par in configs(SMALL, 2, 4096, 1, pinned, stack)} == {1}


def test_context_parallelism_of_degrees_that_are_not_powers_of_two():
    """A CP rank takes two halves of a sequence (load balance): the sequence must split into 2·cp
    parts, 6 for cp = 3 and 8 for cp = 4, whatever the powers of two say (3,078 is 6 · 513, 4,104 is
    8 · 513: neither is a multiple of 2^cp)."""
    assert 3 in {lay.cp for lay in layouts(SMALL, 3, 3078, 3)}
    assert 4 in {lay.cp for lay in layouts(SMALL, 4, 4104, 4)}


def test_sequence_parallelism_needs_a_cp_ranks_tokens_to_split_over_tp():
    """tp = 4, cp = 2 on 2,052 tokens: a CP rank holds 1,026, which 4 TP ranks do not split."""
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(4, 2, 1, 1)}
    assert list(configs(SMALL, 8, 2052, 1, pinned, stack)) == []
    unsplit = pinned | {"sequence_parallel": False}
    assert {par.layout for par in configs(SMALL, 8, 2052, 1, unsplit, stack)} == {
        Layout(4, 2, 1, 1)
    }


def test_virtual_stages_pinned_without_a_pipeline_reach_the_validator():
    """The search passes a pinned V on (the layout's check then names it), it does not drop it."""
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(1, 1, 1, 2), "schedule": "1f1b", "virtual_stages": 2}
    assert {par.virtual_stages for par in configs(SMALL, 2, 4096, 8, pinned, stack)} == {2}


def test_zero_bubble_keeps_its_few_microbatch_counts():
    """Only interleaving drops counts below the ranks when larger ones exist; zero-bubble keeps them."""
    stack = load_stack("fourd")
    pinned = OPEN | {"layout": Layout(1, 1, 2, 1), "schedule": "zero-bubble"}
    assert {par.microbatches for par in configs(SMALL, 2, 4096, 8, pinned, stack)} == {8, 4, 2, 1}


def test_full_recomputation_adds_its_attention_core_at_a_length_that_is_not_a_power_of_two():
    """At 3,072 tokens the linear layers' 2^23 FLOPs a token and the attention core's 3 · 2^22 share
    a bit: the hardware FLOPs add them."""
    layers, heads, head_dim, seq = 4, 4, 64, 3072
    redone = layers * _linear_flops_per_token() + 4 * layers * heads * head_dim * seq
    par = Parallelism(
        layout=Layout(1, 1, 1, 1), schedule="1f1b", microbatches=1, zero=0, recompute="full"
    )
    plan = evaluate(Job(SMALL, H100, par, seq, 1))
    assert plan.hw_tflops_per_gpu == pytest.approx(
        plan.tflops_per_gpu * (1 + redone / SMALL.flops_per_token(seq)), rel=1e-12
    )


def test_a_stack_whose_sharded_stages_a_pipeline_excludes_falls_back_to_zero_0(
    tmp_path, monkeypatch
):
    """A user stack that shards only with ZeRO 2 and 3 and pipelines only with ZeRO 0 and 1: on a
    pipelined layout nothing it shards with is left, so the search tries ZeRO 0."""
    monkeypatch.setenv("FOURD_HOME", str(tmp_path))
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "late.toml").write_text("zero = [2, 3]\npipeline_zero = [0, 1]\n")
    stack = load_stack("late")
    pinned = OPEN | {"layout": Layout(1, 1, 2, 2), "schedule": "1f1b"}
    assert {par.zero for par in configs(SMALL, 4, 4096, 8, pinned, stack)} == {0}


def test_a_plan_is_an_immutable_value():
    plan = _plan("none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.chosen = ("tp",)  # type: ignore[misc]


def test_the_json_rounds_memory_to_the_megabyte_and_counts_training_days_unrounded():
    plan = _plan("none")
    out = plan.to_json(train_tokens=1e12)
    assert out["memory_gb"] == {key: round(gb, 3) for key, gb in plan.memory.gb().items()}
    assert any(round(gb, 3) != round(gb, 4) for gb in plan.memory.gb().values())
    assert out["training_days"] == 1e12 / plan.tokens_per_s / 86400


def test_recomputation_is_the_lightest_that_fits_and_hopeless_states_skip_to_the_last_mode():
    """Each configuration gets the first of none, selective, per-op and full whose peak fits with the
    allocator's cache, else the first that fits by emptying it, else full; where the fullest rank's
    weights, gradients and optimizer state alone overflow the GPU, no mode can fit and the search
    takes full recomputation without trying the modes between: the same plan as trying them all."""
    from fourd.layout import RECOMPUTE
    from fourd.plan.memory import GB, peak_memory

    model = parse_model_spec("layers=24,dim=4096,ffn=16384,heads=32,kv_heads=8,vocab=32000")
    capacity = H100.gpu.memory_gb * GB

    def tried_in_turn(job: Job) -> tuple[str, float]:
        trials = []
        for recompute in RECOMPUTE:
            trial = dataclasses.replace(job, par=dataclasses.replace(job.par, recompute=recompute))
            trials.append((recompute, peak_memory(trial)[1]))
        with_cache = [(r, m) for r, m in trials if m.held <= capacity]
        emptied = [(r, m) for r, m in trials if m.total + m.reserve <= capacity]
        recompute, memory = (with_cache or emptied or trials[-1:])[0]
        return recompute, memory.total

    def planned(gpus: int, seq: int, global_seqs: int):
        base = Job(model, H100, Parallelism(layout=Layout(1, 1, 1, 1)), seq, global_seqs)
        return search(base, gpus, OPEN | {"sequence_parallel": False})

    hopeless = planned(1, 32768, 16)  # 6.1 B parameters at 16 B each: 98 GB of states
    roomy = planned(8, 32768, 16)  # the same sharded over 8 ranks: room for recomputed activations
    kinds = set()
    for plan in hopeless + roomy:
        assert (plan.config.recompute, plan.memory.total) == tried_in_turn(plan.job)
        states = plan.memory.states + plan.memory.reserve
        kinds.add((plan.fits, plan.config.recompute, states > capacity))
    assert (False, "full", True) in kinds  # skipped straight to full
    assert any(fits and recompute != "none" for fits, recompute, _ in kinds)  # found between


# Searches whose every configuration the ranking's floor is checked on: each stack's schedules
# (zero-bubble's bubble left out of the floor, DeepSpeed's blocking sends, FSDP2's copies, NeMo's
# BF16 reductions, nanotron's accumulation pass), FP8, GPUs with and without room, and a CPU profile.
RANKED_SEARCHES = [
    ("llama3-70b", "dgx-h100", {"gpus": 64, "seq": 4096, "global_seqs": 64}),
    ("llama3-70b", "dgx-h100", {"gpus": 256, "seq": 8192, "global_seqs": 512, "stack": "nemo"}),
    (
        "llama3-8b",
        "dgx-a100-40gb",
        {"gpus": 64, "seq": 4096, "global_seqs": 256, "stack": "deepspeed"},
    ),
    ("llama3-8b", "aws-p5", {"gpus": 32, "seq": 8192, "global_seqs": 128, "stack": "nanotron"}),
    ("llama3-8b", "dgx-h100", {"gpus": 64, "seq": 8192, "global_seqs": 128, "stack": "fsdp2"}),
    ("llama3-8b", "dgx-h100", {"gpus": 32, "seq": 8192, "global_seqs": 64, "precision": "fp8"}),
    ("llama3-70b", "dgx-a100-40gb", {"gpus": 16, "seq": 4096, "global_seqs": 32}),
    ("debug", "cpu", {"gpus": 4, "seq": 256, "global_seqs": 8}),
]


def _ranked_request(model: str, cluster: str, values: dict, tmp_path):
    from test_train_auto import LOCAL as LOCAL_CPU

    from fourd.model.config import get_preset
    from fourd.plan.request import resolve

    if cluster == "cpu":
        (tmp_path / "local.toml").write_text(LOCAL_CPU)  # a 2-core CPU profile
        cluster = str(tmp_path / "local.toml")
    return resolve(get_preset(model), load_cluster(cluster), values)


@pytest.mark.parametrize("case", RANKED_SEARCHES, ids=lambda case: f"{case[0]}-{case[1]}")
def test_every_configurations_step_is_at_least_its_floor(case, tmp_path):
    """step_floor is a floor bit for bit: what lets the ranking leave configurations untimed."""
    from fourd.plan.perf import step_floor

    found = search(*_search_args(_ranked_request(*case, tmp_path)))
    schedules = {plan.config.schedule for plan in found}
    assert len(found) > 10 and "1f1b" in schedules
    for plan in found:
        assert step_floor(plan.job) <= plan.step.step_s, plan.config
    assert any(step_floor(plan.job) < plan.step.step_s for plan in found)


@pytest.mark.parametrize("case", RANKED_SEARCHES, ids=lambda case: f"{case[0]}-{case[1]}")
def test_the_ranking_of_the_top_plans_is_the_full_searchs_first(case, tmp_path):
    """rank(top=k) gives the first k plans of the whole search, equal and in the same order, with the
    whole search's counts (on 16 A100s of 40 GB nothing fits Llama 3 70B: the smallest come first)."""
    from fourd.plan.search import rank

    args = _search_args(_ranked_request(*case, tmp_path))
    every = search(*args)
    for top in (1, 3, 10):
        ranking = rank(*args, top=top)
        assert ranking.plans == every[:top]
        assert (ranking.searched, ranking.fitting) == (len(every), sum(p.fits for p in every))


def test_a_ranking_with_too_few_fitting_plans_lists_the_smallest_of_the_rest(tmp_path):
    """Llama 3 70B on 32 A100s of 40 GB at 16K tokens: 2 of 2,774 configurations fit."""
    from fourd.plan.search import rank

    values = {"gpus": 32, "seq": 16384, "global_seqs": 32}
    args = _search_args(_ranked_request("llama3-70b", "dgx-a100-40gb", values, tmp_path))
    ranking = rank(*args, top=10)
    assert (ranking.searched, ranking.fitting) == (2774, 2)
    assert [plan.fits for plan in ranking.plans] == [True] * 2 + [False] * 8
    assert ranking.plans == search(*args)[:10]


def _search_args(req) -> tuple:
    return req.base, req.gpus, req.fixed, req.open
