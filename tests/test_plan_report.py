"""`fourd plan`'s text report (fourd.plan.report): every figure it prints is the plan's own, read back
from the text and recomputed here from the Plan's fields, for plans that differ in schedule, fit and
switches."""

import re

import pytest

from fourd.model.config import get_preset
from fourd.plan.cluster import load_cluster
from fourd.plan.kernels import attention_time
from fourd.plan.report import plan_report, search_report, tp_collectives_words, why
from fourd.plan.request import plans, resolve
from fourd.plan.search import Ranking

# (model, cluster, settings): a plan with each schedule, one that does not fit, one with every
# setting pinned, TP overlap and DP after the backward, one eager with blocking pipeline sends
CASES = {
    "405b-interleaved": (
        "llama3-405b",
        "llama3-h100",
        {
            "layout": "tp=8,pp=16,dp=128",
            "seq": 8192,
            "global_batch_tokens": "16M",
            "schedule": "interleaved",
            "virtual_stages": 2,
            "train_tokens": "15.6T",
        },
    ),
    "70b-1f1b-few-microbatches": (
        "llama3-70b",
        "dgx-h100",
        {
            "layout": "tp=8,pp=4,dp=4",
            "seq": 4096,
            "global_batch_tokens": "256K",
            "schedule": "1f1b",
            "microbatches": 1,
            "zero": 1,
        },
    ),
    "70b-zero-bubble-overlaps": (
        "llama3-70b",
        "dgx-h100",
        {
            "layout": "tp=8,pp=8,dp=2",
            "seq": 4096,
            "global_batch_tokens": "1M",
            "schedule": "zero-bubble",
            "microbatches": 16,
            "tp_overlap": "on",
            "dp_overlap": "off",
            "zero": 1,
            "recompute": "none",
            "compiled": "on",
        },
    ),
    "405b-does-not-fit": (
        "llama3-405b",
        "dgx-a100-40gb",
        {"layout": "tp=8,dp=2", "seq": 8192, "global_batch_tokens": "1M", "recompute": "none"},
    ),
    "8b-eager-blocking-sends": (
        "llama3-8b",
        "dgx-h100",
        {
            "layout": "tp=2,pp=2,dp=4",
            "seq": 4096,
            "global_batch_tokens": "1M",
            "compiled": "off",
            "fused_kernels": "off",
            "pipeline_comm": "blocking",
        },
    ),
}

# the search table's heading, its number of rows in braces
TOP = "Top {} (fitting with the allocator's cache first, then fitting without it; by tokens/s)"


def _plan(case: str):
    model, cluster, settings = CASES[case]
    request = resolve(get_preset(model), load_cluster(cluster), settings)
    return plans(request)[0], request.train_tokens


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.1f} %"


def _row(text: str, label: str) -> list[str]:
    """The fields after `label` on the report's line that starts with it (two spaces in)."""
    for line in text.splitlines():
        if line.startswith("  " + label + " "):
            return line[len(label) + 2 :].split()
    raise AssertionError(f"no line {label!r} in the report")


@pytest.mark.parametrize("case", CASES)
def test_the_header_names_what_runs(case):
    plan, train_tokens = _plan(case)
    config, job = plan.config, plan.job
    text = plan_report(plan, train_tokens)
    header, settings = text.splitlines()[:2]
    assert header.startswith(f"fourd plan: {plan.gpus:,} × {plan.cluster.gpu.name} ")
    assert header.endswith(f"{plan.global_seqs * plan.seq:,} tokens per step")
    schedule = config.schedule
    if config.schedule == "interleaved":
        schedule += f" V={config.virtual_stages}"
    assert f" · {schedule} · " in settings
    kernels = "compiled" if job.compiled else ("fused kernels" if job.work.fused else "eager")
    assert f" · {kernels} · stack {job.stack}" in settings
    assert (" · TP overlapped" in settings) == job.work.tp_overlap
    assert (" · DP after backward" in settings) == (not job.dp_overlapped)
    blocking = job.pipeline_sends == "blocking" and config.layout.pp > 1
    assert settings.endswith(" · blocking pipeline sends") == blocking
    names = ", ".join(plan.chosen)
    chosen = f"  chosen by the planner (fastest that fits with the allocator's cache): {names}"
    assert (text.splitlines()[2] == chosen) == bool(plan.chosen)


def test_the_cases_cover_every_branch_of_the_header():
    """Each switch the header names is on in one case and off in another."""
    jobs = [_plan(case)[0].job for case in CASES]
    assert {job.work.tp_overlap for job in jobs} == {True, False}
    assert {job.dp_overlapped for job in jobs} == {True, False}
    assert {job.compiled for job in jobs} == {True, False}
    assert {_plan(case)[0].fits for case in CASES} == {True, False}
    assert {bool(_plan(case)[0].chosen) for case in CASES} == {True, False}
    assert {_plan(case)[0].config.schedule for case in CASES} == {
        "interleaved",
        "1f1b",
        "zero-bubble",
    }


@pytest.mark.parametrize("case", CASES)
def test_memory_rows_add_up_to_the_total_and_its_verdict(case):
    plan, train_tokens = _plan(case)
    text = plan_report(plan, train_tokens)
    gigabytes = plan.memory.gb()
    assert _row(text, "weights") == [f"{gigabytes['params']:.1f}"]
    assert _row(text, "optimizer state") == [f"{gigabytes['optimizer']:.1f}"]
    total = _row(text, f"total of {plan.cluster.gpu.memory_gb:.0f} GB")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    if plan.fits and plan.memory.held > plan.cluster.gpu.memory_gb * 1e9:
        # the tensors fit, with the allocator's cache they do not (the 70B case: 73.4 + 13.9 GB)
        verdict = "fits only by emptying the allocator's cache (retries slow the steps)"
    assert " ".join(total) == f"{gigabytes['total'] + gigabytes['reserve']:.1f} {verdict}"
    cache = _row(text, "and the allocator cache (freed when short)")
    assert cache == [f"{gigabytes['fragmentation']:.1f}"]


@pytest.mark.parametrize("case", CASES)
def test_each_step_term_is_its_share_of_the_step(case):
    plan, train_tokens = _plan(case)
    step = plan.step
    text = plan_report(plan, train_tokens)
    for label, seconds in (
        ("pipeline bubble", step.bubble_s),
        ("data-parallel collectives, exposed", step.dp_exposed_s),
        ("optimizer update", step.optimizer_s),
    ):
        assert _row(text, label) == [f"{seconds:.3f}", *_pct(seconds / step.step_s).split()]
    assert _row(text, "step") == [f"{step.step_s:.3f}"]
    # an "of which" row stands only when its term is not zero
    assert ("of which TP collectives" in text) == bool(step.tp_comm_s)


@pytest.mark.parametrize("case", CASES)
def test_throughput_rows_are_the_plans(case):
    plan, train_tokens = _plan(case)
    text = plan_report(plan, train_tokens)
    assert _row(text, "tokens/s") == [f"{plan.tokens_per_s:,.0f}"]
    assert _row(text, "model TFLOP/s per GPU") == [f"{plan.tflops_per_gpu:.1f}"]
    assert (
        _row(text, f"MFU (of {plan.cluster.gpu.peak_tflops:g} TFLOP/s peak)")
        == _pct(plan.mfu).split()
    )
    if train_tokens:
        days = train_tokens / plan.tokens_per_s / 86400
        assert _row(text, f"days for {train_tokens:.3g} tokens") == [f"{days:.1f}"]
    else:
        assert "days for" not in text


def test_llama3_405b_takes_its_days_and_names_its_bubble():
    """15.6T tokens on 16,384 GPUs: the days are the tokens over the rate; the bubble sentence
    prints the interleaved closed form with its numbers, p = 16, V = 2, m = 16 (m >= p)."""
    plan, train_tokens = _plan("405b-interleaved")
    assert train_tokens == 15.6e12
    assert (plan.config.layout.pp, plan.config.virtual_stages) == (16, 2)
    assert plan.config.microbatches == 16
    bubble = why(plan)[0]
    assert "the interleaved schedule idles (p−1)/(V·m) = 15/(2·16) = " in bubble
    assert f"= {_pct(plan.step.bubble_s / plan.step.compute_s)} of compute" in bubble
    assert f"({_pct(plan.bubble_fraction)} of the step)" in bubble


def test_the_bubble_sentence_of_each_schedule():
    one_f_one_b, _ = _plan("70b-1f1b-few-microbatches")
    assert one_f_one_b.config.microbatches == 1  # 64 sequences over 4 replicas, 16 each: m = 1
    assert "the 1f1b schedule idles (p−1)/m = 3/1 = " in why(one_f_one_b)[0]
    zero_bubble, _ = _plan("70b-zero-bubble-overlaps")
    assert "idles (p−1)·(t_f + t_i − t_w)/(m·(t_f + t_b)) = " in why(zero_bubble)[0]


def test_an_interleaved_pipeline_with_fewer_microbatches_than_stages():
    """m < p: the closed form counts the (V−1)(m−1)/V the interleaving saves, with its numbers."""
    request = resolve(
        get_preset("llama3-70b"),
        load_cluster("dgx-h100"),
        {
            "layout": "tp=8,pp=8,dp=2",
            "seq": 4096,
            "global_batch_tokens": "64K",
            "schedule": "interleaved",
            "virtual_stages": 2,
            "microbatches": 2,
        },
    )
    plan = plans(request)[0]
    bubble = why(plan)[0]
    assert "(p−1−(V−1)(m−1)/V)/m = (7−1·1/2)/2 = " in bubble


def test_half_the_replicas_is_the_same_batch_on_half_the_gpus():
    plan, _ = _plan("405b-interleaved")
    half = why(plan)[1]
    per_replica = plan.global_seqs // plan.config.layout.dp
    assert half.startswith(f"With half the replicas (dp=64, {2 * per_replica} sequences and 32 ")
    assert "same global batch on 8,192 GPUs" in half
    assert f"instead of {_pct(plan.mfu)}" in half
    # the same run planned on its own: 64 replicas, twice the microbatches, every setting as chosen
    config = plan.config
    _, cluster, settings = CASES["405b-interleaved"]
    halved = resolve(
        get_preset("llama3-405b"),
        load_cluster(cluster),
        settings
        | {
            "layout": "tp=8,pp=16,dp=64",
            "microbatches": 2 * config.microbatches,
            "zero": config.zero,
            "recompute": config.recompute,
            "compiled": "on" if plan.job.compiled else "off",
        },
    )
    other = plans(halved)[0]
    bubble = _pct(other.step.bubble_s / other.step.compute_s)
    assert f"the bubble would be {bubble} of compute and MFU {_pct(other.mfu)} instead" in half


def test_dp_traffic_and_its_exposed_part_are_the_steps():
    plan, _ = _plan("70b-zero-bubble-overlaps")
    step = plan.step
    assert not plan.job.dp_overlapped and step.dp_total_s > 0
    sentences = why(plan)
    assert (
        f"Data-parallel traffic: {step.dp_total_s:.3f} s per step, {step.dp_exposed_s:.3f} s of "
        "it exposed"
    ) in " ".join(sentences)
    tp_share = f"{tp_collectives_words(plan)} take {_pct(step.tp_comm_s / step.step_s)}"
    assert (tp_share in " ".join(sentences)) == bool(step.tp_comm_s)


def test_a_stack_that_gathers_in_its_step_says_so():
    request = resolve(
        get_preset("llama3-8b"),
        load_cluster("dgx-h100"),
        {
            "layout": "dp=16",
            "seq": 4096,
            "global_batch_tokens": "1M",
            "zero": 1,
            "stack": "deepspeed",
        },
    )
    plan = plans(request)[0]
    assert plan.job.gathers_in_step and plan.step.dp_exposed_s > 0
    assert why(plan)[-1] == (
        "Stack deepspeed gathers ZeRO 1's updated weights inside the optimizer's step, where no "
        "compute hides them."
    )


def test_search_table_rows_are_each_plans_figures():
    request = resolve(get_preset("llama3-8b"), load_cluster("dgx-h100"), {"gpus": 64, "seq": 8192})
    found = plans(request)
    text = search_report(Ranking.of(found, 5), None)
    lines = text.splitlines()
    assert lines[0].startswith(f"searched {len(found):,} configurations, ")
    assert f"{sum(plan.fits for plan in found):,} fit in memory" in lines[0]
    header = lines.index(TOP.format(5))
    columns = "layout schedule m mbs zero recompute GB step s tokens/s MFU"
    assert lines[header + 1].split() == columns.split()
    for plan, line in zip(found[:5], lines[header + 2 : header + 7], strict=True):
        config = plan.config
        fields = line.split()
        schedule = [config.schedule]
        if config.schedule == "interleaved":
            schedule.append(f"V={config.virtual_stages}")
        gigabytes = f"{(plan.memory.total + plan.memory.reserve) / 1e9:.1f}"
        assert fields == [
            str(config.layout),
            *schedule,
            str(config.microbatches),
            str(plan.micro_seqs),
            str(config.zero),
            config.recompute,
            gigabytes + ("" if plan.fits else "!"),
            f"{plan.step.step_s:.3f}",
            f"{plan.tokens_per_s:,.0f}",
            *_pct(plan.mfu).split(),
        ]
    assert "does not fit" not in text


def test_a_search_where_nothing_fits_marks_every_row_and_says_so():
    request = resolve(
        get_preset("llama3-405b"), load_cluster("dgx-a100-40gb"), {"gpus": 8, "seq": 8192}
    )
    found = plans(request)
    assert not any(plan.fits for plan in found)
    lines = search_report(Ranking.of(found, 3), None).splitlines()
    rows = lines[-4:-1]
    assert all(re.search(r"\d!\s", row) for row in rows)
    assert lines[-1] == (
        "  (!: does not fit; no configuration fits: add GPUs, shorten sequences or use a bigger "
        "GPU)"
    )


@pytest.mark.parametrize("case", CASES)
def test_the_half_replicas_sentence_stands_for_pipelines_of_even_dp(case):
    plan, _ = _plan(case)
    layout = plan.config.layout
    expected = layout.pp > 1 and layout.dp % 2 == 0
    assert any(line.startswith("With half the replicas") for line in why(plan)) == expected


@pytest.mark.parametrize("case", CASES)
def test_tp_and_cp_collectives_take_their_share(case):
    plan, _ = _plan(case)
    step = plan.step
    sentences = why(plan)
    for seconds, what in (
        (step.tp_comm_s, tp_collectives_words(plan)),
        (step.cp_comm_s, "CP all-gathers of K and V"),
    ):
        sentence = f"{what} take {_pct(seconds / step.step_s)} of the step."
        assert (sentence in sentences) == bool(seconds)


def test_tp_overlap_names_what_it_leaves_exposed():
    """With TP overlapped, Why's TP share is the part the GEMMs do not hide, and says so: never
    "not overlapped" for a stack that overlaps."""
    values = {"layout": "tp=8,dp=2", "seq": 8192, "global_batch_tokens": "1M"}
    shares = {}
    for overlap in (True, False):
        request = resolve(
            get_preset("llama3-70b"),
            load_cluster("dgx-h100"),
            values | {"stack": "nemo", "sequence_parallel": True, "tp_overlap": overlap},
        )
        plan = plans(request)[0]
        assert plan.job.work.tp_overlap is overlap
        text = " ".join(why(plan))
        shares[overlap] = plan.step.tp_comm_s
        share = _pct(shares[overlap] / plan.step.step_s)
        exposed = f"TP collectives the overlap leaves exposed take {share}"
        assert (exposed in text) is overlap
        assert ("TP collectives (not overlapped)" in text) is not overlap
    assert 0 < shares[True] < shares[False]


def test_pipeline_words_only_with_a_pipeline():
    """Blocking sends named where there are sends: pp > 1, not pp = 1."""
    for layout, named in (("tp=8,dp=2", False), ("tp=8,pp=2", True)):
        request = resolve(
            get_preset("llama3-8b"),
            load_cluster("dgx-h100"),
            {
                "layout": layout,
                "seq": 4096,
                "global_batch_tokens": "1M",
                "pipeline_comm": "blocking",
            },
        )
        settings = plan_report(plans(request)[0]).splitlines()[1]
        assert settings.endswith(" · blocking pipeline sends") == named


def test_cp_collectives_are_named_with_context_parallelism():
    request = resolve(
        get_preset("llama3-8b"),
        load_cluster("dgx-h100"),
        {"layout": "tp=8,cp=4", "seq": 65536, "global_batch_tokens": "1M"},
    )
    plan = plans(request)[0]
    share = _pct(plan.step.cp_comm_s / plan.step.step_s)
    assert plan.step.cp_comm_s > 0
    assert f"CP all-gathers of K and V take {share} of the step." in why(plan)
    assert _row(plan_report(plan), "  of which CP collectives")[0] == f"{plan.step.cp_comm_s:.3f}"


@pytest.mark.parametrize("case", [*CASES, "deepspeed"])
def test_the_gather_in_step_sentence_needs_both_the_stack_and_exposed_dp_time(case):
    if case == "deepspeed":
        request = resolve(
            get_preset("llama3-8b"),
            load_cluster("dgx-h100"),
            {"layout": "dp=16", "seq": 4096, "global_batch_tokens": "1M", "stack": "deepspeed"},
        )
        plan = plans(request)[0]
    else:
        plan, _ = _plan(case)
    named = any(line.startswith(f"Stack {plan.job.stack} gathers ") for line in why(plan))
    assert named == bool(plan.job.gathers_in_step and plan.step.dp_exposed_s)


@pytest.mark.parametrize("case", CASES)
def test_the_bubble_sentence_stands_for_pipelines_only(case):
    plan, _ = _plan(case)
    stated = any(line.startswith("Pipeline bubble:") for line in why(plan))
    assert stated == (plan.config.layout.pp > 1)
    assert {_plan(case)[0].config.layout.pp > 1 for case in CASES} == {True, False}


def _interleaved_bubble(microbatches: int, virtual_stages: int) -> str:
    """The bubble sentence of Llama 3 70B on 8 stages of TP 8, two replicas, 4,096-token sequences,
    as many sequences a replica as microbatches."""
    request = resolve(
        get_preset("llama3-70b"),
        load_cluster("dgx-h100"),
        {
            "layout": "tp=8,pp=8,dp=2",
            "seq": 4096,
            "global_batch_tokens": 2 * microbatches * 4096,
            "schedule": "interleaved",
            "virtual_stages": virtual_stages,
            "microbatches": microbatches,
        },
    )
    return why(plans(request)[0])[0]


def test_the_interleaved_bubble_names_its_numbers_on_each_side_of_m_equal_p():
    """80 layers on 8 stages of V = 5 chunks (2 layers each): m = 4 < p = 8 counts what the
    interleaving saves, (7 − 4·3/5)/4; m = 8 and m = 16 (m ≥ p) divide by V·m."""
    assert "idles (p−1−(V−1)(m−1)/V)/m = (7−4·3/5)/4 = " in _interleaved_bubble(4, 5)
    assert "idles (p−1)/(V·m) = 7/(5·8) = " in _interleaved_bubble(8, 5)
    assert "idles (p−1)/(V·m) = 7/(5·16) = " in _interleaved_bubble(16, 5)


def test_cudnn_attention_is_named_where_it_runs_and_nowhere_else():
    """cuDNN's kernel runs where the stack (or the flag) asks for it, attention is fused and the
    GPU has its figures: Megatron-Core on H100; not with FlashAttention-2, not with the scores
    materialized, not on an A100."""
    base = {"layout": "tp=8,dp=2", "seq": 4096, "global_batch_tokens": "1M"}
    for cluster, settings, named in (
        ("dgx-h100", {"stack": "megatron-core"}, True),
        ("dgx-h100", {"fused_attention": "cudnn"}, True),
        ("dgx-h100", {"stack": "megatron-core", "fused_attention": "flash2"}, False),
        ("dgx-h100", {}, False),
        ("dgx-h100", {"fused_attention": "cudnn", "attention": "materialized"}, False),
        ("dgx-a100-40gb", {"stack": "megatron-core"}, False),
    ):
        request = resolve(get_preset("llama3-8b"), load_cluster(cluster), base | settings)
        settings_line = plan_report(plans(request)[0]).splitlines()[1]
        assert (" · cuDNN attention" in settings_line) == named, (cluster, settings)


def test_the_search_reports_its_best_plan_in_full_and_marks_only_what_does_not_fit():
    """The full report is the first (best) plan's; the closing note stands only when the best does
    not fit. Llama 3 8B on 4 A100s of 40 GB at 4,096 tokens: some configurations fit, most not."""
    request = resolve(
        get_preset("llama3-8b"), load_cluster("dgx-a100-40gb"), {"gpus": 4, "seq": 4096}
    )
    found = plans(request)
    assert found[0].fits and not found[-1].fits
    text = search_report(Ranking.of(found, len(found)), None)
    best = plan_report(found[0], None)
    assert text.split("\n\n", 1)[1].startswith(best)
    assert "(!: does not fit" not in text
    marked = [line for line in text.splitlines() if re.search(r"\d!\s", line)]
    assert len(marked) == sum(not plan.fits for plan in found)


def test_the_search_table_names_v_for_interleaved_rows_only():
    request = resolve(
        get_preset("llama3-70b"),
        load_cluster("dgx-h100"),
        {"gpus": 64, "seq": 4096, "global_batch_tokens": "1M", "layout": "tp=8,pp=8,dp=1"},
    )
    found = plans(request)
    schedules = {plan.config.schedule for plan in found}
    assert {"interleaved", "zero-bubble", "1f1b"} <= schedules
    lines = search_report(Ranking.of(found, len(found)), None).splitlines()
    rows = lines[lines.index(TOP.format(len(found))) + 2 :]
    for plan, row in zip(found, rows):
        named = f" {plan.config.schedule} V={plan.config.virtual_stages} " in row
        assert named == (plan.config.schedule == "interleaved"), row


def test_when_only_the_best_fits_the_search_adds_no_note():
    """Llama 3 8B on 2 H100s, ZeRO and microbatches open: of 15 configurations only one fits."""
    settings = {"layout": "dp=2", "seq": 4096, "global_batch_tokens": "128K"}
    settings |= {"recompute": "full", "schedule": "1f1b", "compiled": "off"}
    found = plans(resolve(get_preset("llama3-8b"), load_cluster("dgx-h100"), settings))
    assert [plan.fits for plan in found] == [True] + [False] * 14
    assert [plan.fits_with_cache for plan in found] == [False] * 15
    lines = search_report(Ranking.of(found, 3), None).splitlines()
    assert "does not fit" not in "\n".join(lines)
    assert (
        lines[-1]
        == "  (~: fits only by emptying the allocator's cache; its retries slow the steps)"
    )
    marks = [re.search(r"\d([~!])\s", line).group(1) for line in lines[-4:-1]]
    assert marks == ["~", "!", "!"]


def test_an_interleaved_schedule_of_one_virtual_stage_idles_as_1f1b():
    """Interleaving pinned with V = 1: the bubble is (p−1)/m, not (p−1)/(V·m) with V = 1 written."""
    request = resolve(
        get_preset("llama3-70b"),
        load_cluster("dgx-h100"),
        {
            "layout": "tp=8,pp=8,dp=2",
            "seq": 4096,
            "global_batch_tokens": "1M",
            "schedule": "interleaved",
            "virtual_stages": 1,
        },
    )
    plan = plans(request)[0]
    assert (plan.config.schedule, plan.config.virtual_stages) == ("interleaved", 1)
    m = plan.config.microbatches
    assert f"the interleaved schedule idles (p−1)/m = 7/{m} = " in why(plan)[0]


def test_plans_that_keep_the_allocators_cache_rank_before_faster_ones_that_empty_it():
    """Llama 3 8B on 8 H100s without recomputation: the fastest configuration that fits does so only
    by emptying the allocator's cache, and the search ranks it after every one that fits with the
    cache (also when asked for its first plans only), and marks it."""
    from fourd.plan.memory import OVERFLOWS, ROOMY, TIGHT

    settings = {"gpus": 8, "seq": 4096, "global_batch_tokens": "256K", "recompute": "none"}
    request = resolve(get_preset("llama3-8b"), load_cluster("dgx-h100"), settings)
    found = plans(request)
    rooms = [plan.room for plan in found]
    assert rooms == sorted(rooms) and {ROOMY, TIGHT, OVERFLOWS} <= set(rooms)
    fastest = max((plan for plan in found if plan.fits), key=lambda plan: plan.tokens_per_s)
    assert fastest.room == TIGHT and found[0].room == ROOMY
    assert fastest.tokens_per_s > found[0].tokens_per_s
    shown = found.index(fastest) + 2
    assert [plan.config for plan in plans(request, top=shown)] == [
        plan.config for plan in found[:shown]
    ]
    lines = search_report(Ranking.of(found, shown), None).splitlines()
    rows = lines[lines.index(TOP.format(shown)) + 2 :][:shown]
    marks = [re.search(r"\d\.\d([ ~!]) ", row).group(1) for row in rows]  # after the GB
    assert marks == [" "] * (shown - 2) + ["~", "~"]


def test_long_sequences_say_what_attention_takes_and_short_ones_do_not():
    """At 131,072 tokens (Llama 3 8B, CP 8 on one server, full recomputation) Why gives the attention
    kernels' seconds: each layer's forward, its backward and the forward again a microbatch, by hand
    from the kernel model, over the slowest rank's 32 layers and its microbatches, and their
    12·L·H·Q·T share of the model FLOPs; at 2,048 tokens attention is under a tenth of the step and
    Why says nothing of it."""
    long_request = resolve(
        get_preset("llama3-8b"),
        load_cluster("dgx-h100"),
        {
            "layout": "cp=8",
            "seq": 131072,
            "global_batch_tokens": "1M",
            "stack": "nemo",
            "recompute": "full",
        },
    )
    plan = plans(long_request)[0]
    model, work = plan.model, plan.job.work
    forward, backward = attention_time(
        131072 // 8, 131072, model.heads, model.head_dim, plan.cluster, True, "cudnn"
    )
    seconds = (2 * forward + backward) * model.layers * plan.config.microbatches
    share = 12 * 32 * 32 * 128 * 131072 / model.flops_per_token(131072)
    assert work.recompute == "full"
    assert (
        f"Attention at 131,072 tokens a sequence: its kernels take {seconds:.3f} s per step on the "
        f"slowest rank ({_pct(seconds / plan.step.step_s)} of the step) and do {_pct(share)} of the "
        "model FLOPs."
    ) in why(plan)
    short_request = resolve(
        get_preset("llama3-8b"),
        load_cluster("dgx-h100"),
        {"layout": "tp=8", "seq": 2048, "global_batch_tokens": "1M", "stack": "nemo"},
    )
    assert not any(line.startswith("Attention at") for line in why(plans(short_request)[0]))
