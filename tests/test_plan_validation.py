"""The planner against the public validation suite (benchmarks/validation/runs.toml): the out-of-sample error
is pinned, so that a change to the model cannot silently undo it; refit (validate_planner.py --fit) and
update the figures here together with the fitted numbers when runs.toml or the model changes."""

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "benchmarks" / "validate_planner.py"
DATA = ROOT / "benchmarks" / "validation" / "runs.toml"
# validate_planner.py --json, 2026-12-02: the 114-row suite of 2026-12-01 gave 0.07617088890506425 and
# 0.06503238757005594 with the stacks of 2026-12-02; the 34 rows pre-registered on 2026-12-02 (nanotron,
# OLMo-core, TinyLlama, MaxText, FlagPerf on H100) are in it now, each on its stack; 0.08992954304830025
# and 0.05472446813976739 before the block's count followed what autograd keeps (2026-12-02, refitted);
# 0.08905048855253575 before ZeRO 1's weights were gathered inside the optimizer's step where the stack does
# (nanotron, DeepSpeed, fourd: 2026-12-04, refitted); 0.08816143561342603 before the 45 rows of NVIDIA's DGX
# Cloud Benchmarking recipes were pre-registered (2026-12-05, at 9a0c182; the model unchanged); with them
# 0.08314446549731366 before the stacks' fused attention kernel (cuDNN's on Hopper for Transformer Engine),
# 0.07581141889577202 before hidden traffic's slowdown of the compute beside it was Lee et al.'s (refitted),
# 0.07395105062534314 before the 39 rows of the DGX Cloud recipes' 25.04.01 release were pre-registered
# (2026-12-05, at 7f045ba; the model unchanged), 0.07172886328909012 before the older release's Nemotron-4
# 340B and GPT-3 175B rows were pinned to FlashAttention-2 as their recipes run them, 0.07169040312731874
# before each attention kernel's rate followed its head dimension (Shah et al. 2024; refitted),
# 0.07021966102102989 before Lambda's 6 rows were pre-registered (2026-12-05, at 0cca9b9; the model unchanged),
# 0.07673585047072808 before a stack's autocast over FP32 weights cost its casts and gradient sums and
# eager attention its own kernels (the fit not taken: docs/planner.md, "Autocast and eager attention"),
# 0.07256037775750804 before a collective's latency was NCCL's (a call, NVLink and network steps) and
# DDP stacks reduced their gradients per bucket, nanotron split its pipeline by cost and GPT-2's gelu_new
# was eight eager ops (2026-12-06), 0.07037945294495994 before nanotron's rows ran on AWS p5's EFA network
# as fitted to nccl-tests (the aws-p5 preset, 2026-12-06), 0.06418395151669619 before the
# Megatron-LM README's two strong-scaling rows were pre-registered (2026-12-06, at e4976d7; the model
# unchanged), 0.06438018064098927 before Megatron-LM's and NeMo's interleaved exchanges were
# overlapped (`interleaved-overlapped`), 0.0651206340944966 before nanotron's FP32 gradient accumulator
# paid its pass every microbatch (`grad_accumulate_pass`), 0.06335938726726874 before the input
# embedding's gradients were reduced after the backward that computes them last, 0.06290948992512864
# before the rows of models that tie their output projection to the embedding planned them tied,
# 0.06286153327994658 before FSDP2's copies around its gathers and reductions (`sharding_copies`),
# 0.06251785204815133 before the 34 FP8 rows (pre-registered at f050f51; the 240 rows before them are
# unchanged by FP8); 0.06333603502849225 with torchtitan's 9 Float8 rows included (kept excluded:
# docs/planner.md, FP8), 0.060803461059040886 before the 18 GB200 rows (pre-registered at 3096bde with a
# datasheet GB200 profile; 0.06897854000124291 with them, the model unchanged) and before each stack numbered
# its ranks as it does (`rank_order`: Megatron's, DeepSpeed's, torchtitan's and nanotron's pipeline
# outermost) and GB200's GEMM efficiency was fitted on its first row (0.06306852579305472 over the 257
# rows before the GB200 ones); 0.06465185023297317 before NeMo's performance recipes reduced their
# gradients in BF16 (the nemo preset's grad_reduce); 0.06267115658924392 before FP8's sequence-parallel
# all-gathers moved FP8 (1 B an element, as Transformer Engine gathers them); 0.06299294559516253 before
# InternEvo's 46 rows (pre-registered at ed0ac15: 12.8 % at their first predictions); 0.07237869493324402
# with them before its stack's Hybrid ZeRO (all-reduced gradients, weights broadcast rank by rank) and
# flash-attention 1; 0.06350884620133561 before its ZeRO 1 within a server was planned so (HSDP replica
# groups of ZeRO 1) rather than as ZeRO 0; 0.06432974297883277 before GLM-130B's and BloombergGPT's rows
# (pre-registered at 07899b6: +0.4 and -41.7 % at their first predictions); 0.06523487673497994 with them
# before the search ranked the plans that fit with the allocator's cache before those that fit only by
# emptying it (fourd.plan.memory's ROOMY before TIGHT); 0.06465486851274829 before the Megatron-LM README's
# GPT-3 example (pre-registered at b7ad466: -2.9 % at its first prediction); 0.06454367172459366 before
# BLOOM-176B's 30 topology benchmarks (pre-registered at 1896cb2: 9.4 % at their first predictions);
# 0.0670464430901515 before a pipeline filled and drained through its faster ranks
# (fourd.plan.perf.fill_and_drain_saving; not refitted); 0.06698475135934369 before NeMo 24.07's 12 FP8 rows
# (pre-registered at a75047f: 10.2 % at their first predictions); 0.06812214908798445 before Megatron's
# selective recomputation ran the fused attention kernel again (the stacks' `selective`), and
# 0.06805288569486974 before BloombergGPT's row was excluded (a stack fourd has no profile of, its
# microbatch unstated: docs/planner.md); 0.0673394006530054 before NeMo's long-sequence table's 9 rows
# (pre-registered at 8d413eb: 11.3 % at their first predictions); 0.06844101325816762 before its 8 rows
# on DGX B200 (pre-registered at c71dcce with a datasheet B200 profile: 2.6 % at their first predictions);
# 0.06754125384950929 before Megatron-Bridge's 40 rows of seven containers (pre-registered at c2de471: 4.0 %
# at their first predictions); 0.06496116129784023 before NeMo AutoModel's row (pre-registered at 1f529af:
# +9.6 % at its first prediction); 0.06503409671488936 before FlagPerf's 9 A800 and H800 rows (pre-registered
# at 9eeaeb7 with the export parts' own profiles: 4.8 % at their first predictions); 0.06467804569029048
# before FlagPerf's 3 A800 fine-tuning rows (pre-registered at f01ef23: 1.6 % at their first predictions);
# 0.06434027418172984 before FlagPerf's 2 H100 FP8 rows (pre-registered at 078d517: 7.8 %);
# 0.0644044974961532 before the backward's FP8 GEMMs ran at the GPU's measured FP8 share (fp8_gemm_share);
# 0.06403460480204422 before NeMo's performance summaries on B200 and GB200 (pre-registered at 6d4c5fc: 8.4 %);
# 0.0645373868568199 before llm-foundry's 13 rows ran its FlashAttention in Triton (fused_attention "triton");
# 0.06387790436605337 before llm-foundry's 56 other H100 rows (pre-registered at 10686af: 7.9 %);
# 0.06557514519828644 before its 132 other A100 rows (pre-registered at e47804e: 5.8 %); 0.06390993150316461
# before its 18 rows on 128 to 512 H100 (pre-registered at 83bfda6: 10.4 %)
OUT_OF_SAMPLE_MEAN = 0.06501724801738101
# the same rows, each source's mean weighing one (0.061984682432007214 at f31d079 and 0.06135747248866118 at
# 10686af, before llm-foundry's 56 other H100 rows; 0.06172758272815046 before its 132 other A100 rows;
# 0.0616426210011337 before its 18 rows on 128 to 512 H100)
OUT_OF_SAMPLE_SOURCE_MEAN = 0.062491386859822445
# memory: 0.05689710306513873 before a selectively recomputed layer held its recomputed activations in its
# backward (the allocator's share refitted, 25.2 -> 19.5 %); 0.11432479251366065 with torchtitan's Float8
# rows included, 7 of them with memory (its 2025 H200 rows +43 and +41 %, the 70B on TP 8 -21 %)
MEMORY_MEAN = 0.0414102990385774
# the worst out-of-sample row, the same run: nanotron's 80B on 4 nodes (TP 8 × PP 4, 14.8 % MFU), 62.5 % too
# fast (nanotron's 1.34B on 64 nodes was, 64.5 %, before a collective's latency was NCCL's and nanotron
# reduced its gradients per DDP bucket: now 61.7 %; Lambda's Hugging Face GPT-2 baseline on one H100 was,
# 65.6 %, before its eager attention was counted: 41.2 %, and 28.7 % since gelu_new is eight ops; the
# 80B's was 0.6254853399614118 before its pipeline's sends crossed EFA, and 0.625480990134958 before
# nanotron's FP32 gradient accumulator paid its pass, and 0.6051363851745422 before its pipeline filled and
# drained through its faster ranks)
OUT_OF_SAMPLE_MAX = 0.6053633338768019
# the same run: each multi-scale series anchored on its smallest row (issue 23's anchored mean), and the 80 %
# intervals' leave-one-source-out coverage and median half-widths (before the DGX Cloud rows, 2026-12-05:
# 0.19408414207804067, 0.7204968944099379, 0.12288375835434162 and 0.09572641380476776; with them, before
# the stacks' fused attention kernel: 0.09529469472430448, 0.7833333333333333, 0.13393862664399947 and the
# same anchored half-width; before the 25.04.01 release's 39 rows: 0.09427357961392786, 0.7375,
# 0.12288375835434162 and 0.52833652099134; with them, the two releases judged as two sources:
# 0.06669644590467493, 0.6883116883116883, 0.09682821366944094 and 0.025484264771055587; left out
# together, before Megatron's stacks shared their groups: 0.801948051948052 and 0.1700953140613961; before
# the head dimension: 0.0666806333706994, 0.7857142857142857, 0.12288375835434162 and 0.52833652099134; before
# anchored intervals dropped the generation first: 0.7727272727272727 and 0.5283957895589548; before
# anchored step times were ranked over their spreads and grouped by shape: 0.7662337662337663 and
# 0.2172910549769187; before Lambda's rows: 0.06668797721150904, 0.788961038961039 and 0.039837614437361335;
# before autocast's casts and eager attention: 0.06601859351380727, 0.7911392405063291 and
# 0.04072902350613772; before NCCL's latencies, DDP's buckets, nanotron's split and gelu_new:
# 0.06573098207177086, 0.7848101265822784, 0.12539962440402075 and 0.039589643803991326; before nanotron's
# rows ran on the aws-p5 preset: 0.06250583380218455 and 0.039549523121358954, the rest unchanged; before
# the Megatron-LM README's strong-scaling rows: 0.05689250000319811, 0.8037974683544303 and
# 0.039814718188875275; before Megatron's interleaved exchanges were overlapped: 0.05661803941560352, 0.8
# and 0.11663985193739568; before nanotron's gradient accumulation pass: 0.056557954014702344 and 0.79375; before the embedding's
# gradients were reduced last: 0.05585604241268038 and 0.040512567537487554; before tied embeddings:
# 0.054556444621573934, 0.8 and 0.04104427504867747; before FSDP2's copies: 0.05451518445833273 and
# 0.04129344008624947; before an anchored target ran the anchor's virtual stages: 0.05451317832307416;
# before the FP8 rows, whose six series join the suite's: 0.054294005868097815, 0.803125,
# 0.12824231788016394 and 0.041236744896573585; with torchtitan's Float8 rows included: 0.0453171717868354,
# 0.7862407862407862, 0.02601656571191835 and, for memory, 0.4271307415679855; before the GB200 rows and
# the stacks' rank orders: 0.045798831899665125, 0.7810026385224275, 0.0958080887995667 and
# 0.026360274428179342; with the GB200 rows at their first predictions: 0.06557554522623842,
# 0.7518248175182481 and 0.027752175485347474; before NeMo's BF16 gradient reductions:
# 0.042697897240234255, 0.7731707317073171, 0.10653303385950941 and 0.02237729470501304; before FP8's
# all-gathers moved FP8: 0.04189027620425584, 0.7634146341463415 and 0.022660984657710048; before InternEvo's
# rows: 0.041905424555994636, 0.7585365853658537, 0.10877604160582766 and 0.022671183884624302; with them
# before Hybrid ZeRO and flash-attention 1: 0.04982471364795788, 0.7454909819639278, 0.11582903318880933 and
# 0.034284807206142576; before ZeRO 1 within InternEvo's servers: 0.046526051065803736, 0.7695390781563126
# and 0.03409090655772906; before GLM-130B's and BloombergGPT's rows: 0.77 and 0.10877604160582766
# unanchored; with them, before the plans that fit with the allocator's cache ranked first:
# 0.046702547415366 and 0.7729083665338645; before the Megatron-LM README's row: 0.7689243027888446;
# before BLOOM's topology benchmarks: 0.7693836978131213 and 0.11162843603736983 unanchored; with them,
# before fill and drain through the faster ranks: 0.0465093252977483 and 0.7729831144465291; before NeMo
# 24.07's FP8 rows: 0.04624796318993165, 0.776735459662289 and 0.11389701233347704 unanchored; with them,
# before Megatron's selective recomputation ran the attention kernel again: 0.04604898357433932; before
# BloombergGPT's row was excluded: 0.7765567765567766 and 0.12148068041855353 unanchored; before NeMo's
# long-sequence table: 0.7761467889908257 and 0.11932045401240932 unanchored; before its B200 rows:
# 0.7707581227436823 and 0.12148068041855353 unanchored; before Megatron-Bridge's rows: 0.7740213523131673;
# before NeMo AutoModel's: 0.7740863787375415; before FlagPerf's A800 and H800 rows: 0.7744610281923715 and
# 0.11932045401240932 unanchored; before its A800 fine-tuning rows: 0.7663398692810458 and 0.11898405962321301;
# before its H100 FP8 rows, a series of their own (8 -> 16 GPUs): 0.04605213291508577, 0.7642276422764228 and
# 0.03369244650274106 anchored; with them, before the backward's FP8 GEMMs at the measured share:
# 0.04588609897042896, 0.7653721682847896, 0.11544948009507672 unanchored and 0.0336921756868549 anchored;
# before NeMo's performance summaries on B200 and GB200: 0.7734627831715211; before llm-foundry's rows ran
# FlashAttention in Triton: 0.0458977243903126 and 0.7790143084260731; before llm-foundry's 56 other H100
# rows, five series of their own: 0.04590853721481926, 0.78060413354531, 0.09716013356401176 unanchored and
# 0.03407074404805943 anchored; before llm-foundry's A100 rows, and its three tables one family:
# 0.04580545616721095, 0.7853025936599424, 0.10505907846861162 unanchored and 0.035349311632556946 anchored;
# before its rows on 128 to 512 H100 and the series' fused attention family: 0.04863544791466987,
# 0.8085351787773933 and 0.03745985996489365 anchored)
ANCHORED_MEAN = 0.04797458597101065
# validate_planner.leave_source_out on the rows of narayanan2021, torchtitan-a100 and torchtitan-h100-2412
# alone, 2026-12-06 (0.01985133488283246 before the embedding's gradients were reduced last,
# 0.020112909056983784 before tied embeddings, 0.019544263019580316 before FSDP2's copies made torchtitan's
# A100 fit row 2.6 % slower, so that a fit on it alone sets the A100 efficiency higher; 0.034977077743261656
# before Megatron-LM's ranks were numbered its way, the pipeline outermost; 0.03516268579244396 before a
# pipeline filled and drained through its faster ranks, 2026-12-07)
LEAVE_SOURCE_OUT_SMALL = 0.035798563885569866
INTERVAL_COVERAGE = 0.8006681514476615
MEDIAN_HALF_WIDTHS = {
    "unanchored": 0.1097076361021938,
    "anchored": 0.03886256019756473,
    "memory": 0.06933334691431603,
}

pytestmark = pytest.mark.skipif(
    not DATA.is_file(), reason="benchmarks/validation/runs.toml is not in this checkout"
)


def _harness():
    spec = importlib.util.spec_from_file_location("validate_planner", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_out_of_sample_error_is_pinned_and_within_the_targets():
    done = subprocess.run(
        [sys.executable, str(HARNESS), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert (
        d["out_of_sample_mean"] == pytest.approx(OUT_OF_SAMPLE_MEAN, abs=1e-9)
        and d["out_of_sample_mean"] <= 0.10
    )
    assert d["memory_mean"] == pytest.approx(MEMORY_MEAN, abs=1e-9) and d["memory_mean"] <= 0.10
    assert d["out_of_sample_max"] == pytest.approx(OUT_OF_SAMPLE_MAX, abs=1e-9)
    assert d["out_of_sample_source_mean"] == pytest.approx(OUT_OF_SAMPLE_SOURCE_MEAN, abs=1e-9)
    assert d["rows"] >= 30 and d["sources"] >= 6 and 3 * d["fit_rows"] <= d["rows"]
    assert d["anchored_mean"] == pytest.approx(ANCHORED_MEAN, abs=1e-9)
    assert (d["interval_level"], d["interval_coverage"]) == (
        0.8,
        pytest.approx(INTERVAL_COVERAGE, abs=1e-9),
    )
    for kind, half_width in MEDIAN_HALF_WIDTHS.items():
        assert d[f"median_half_width_{kind}"] == pytest.approx(half_width, abs=1e-9), kind
    assert set(d) >= {
        "rows",
        "sources",
        "fit_rows",
        "out_of_sample_mean",
        "out_of_sample_max",
        "memory_mean",
        "per_source",
    }


def test_the_signed_bias_by_stack_and_generation_is_the_held_out_rows_mean():
    """A bias a mean absolute error hides: each stack's and each GPU generation's held-out rows'
    mean signed error, with their count; every held-out row in exactly one group of each. And the
    mean over sources: each source's held-out mean absolute error, each source weighing one."""
    harness = _harness()
    _, runs = harness.load()
    rows = harness.evaluate([run for run in runs if not run.excluded])
    held = [row for row in rows if not row["fit"]]
    s = harness.summary(rows, 1)
    deepspeed = [row["error"] for row in held if row["stack"] == "deepspeed"]
    hopper = [row["error"] for row in held if row["generation"] == "H100/H200"]
    assert s["signed_by_stack"]["deepspeed"] == (
        len(deepspeed),
        pytest.approx(statistics.mean(deepspeed), abs=1e-15),
    )
    assert s["signed_by_generation"]["H100/H200"] == (
        len(hopper),
        pytest.approx(statistics.mean(hopper), abs=1e-15),
    )
    llmfoundry = [abs(row["error"]) for row in held if row["source"] == "llmfoundry"]
    assert s["per_source"]["llmfoundry"] == pytest.approx(statistics.mean(llmfoundry), abs=1e-15)
    assert s["out_of_sample_source_mean"] == pytest.approx(
        statistics.mean(s["per_source"].values()), abs=1e-15
    )
    assert sum(count for count, _ in s["signed_by_stack"].values()) == len(held)
    assert sum(count for count, _ in s["signed_by_generation"].values()) == len(held)
    assert set(s["signed_by_generation"]) == set(harness.GENERATIONS)


def test_the_harness_pins_what_a_row_publishes_and_leaves_the_rest_open():
    v = _harness()
    _, runs = v.load()
    row = next(r for r in runs if r.id == "llama3-t4-16384")
    plan = v.predict(row)
    c = plan.config
    assert (str(c.layout), c.schedule, c.zero, c.recompute, plan.job.compiled) == (
        "tp=8,cp=1,pp=16,dp=128",
        "interleaved",
        1,
        "none",
        False,
    )
    assert (c.virtual_stages, c.microbatches) == (
        8,
        16,
    )  # the planner's fastest where the paper is silent
    assert abs(plan.mfu - row.mfu) <= 0.02  # Llama 3 Table 4 within 2 MFU points
    assert v.cluster_for(row).network.nic_bw_gbps == 50.0  # the row's 400 Gb/s per GPU
    assert v.cluster_for(row).name == "llama3-h100"  # its pods, as the paper states them


def test_a_row_runs_on_the_preset_its_source_evidences():
    """nanotron's rows ran on AWS p5 instances: the aws-p5 preset, whose network is EFA's as nccl-tests
    measured it; a row that says nothing of its cluster gets its GPU's preset."""
    v = _harness()
    _, runs = v.load()
    nanotron = [r for r in runs if r.source == "nanotron-ultrascale"]
    assert len(nanotron) == 26 and {v.cluster_for(r).name for r in nanotron} == {"aws-p5"}
    assert v.cluster_for(nanotron[0]).network.latency_us == 73.0
    torchtitan = next(r for r in runs if r.gpu == "H100-SXM-80GB" and not r.cluster)
    assert v.cluster_for(torchtitan).name == "dgx-h100"


def test_leave_source_out_refits_without_the_source_and_puts_the_numbers_back():
    """`--leave-source-out` judges each source by a fit on the other sources' fit rows: here Narayanan
    et al.'s rows by torchtitan's A100 fit row alone, and torchtitan's by Narayanan's three; the H100
    96 GB row's GPU has no fit row elsewhere, so its source is named, not judged. The fitted constants
    are what they were afterwards."""
    v = _harness()
    _, runs = v.load()
    sources = ("narayanan2021", "torchtitan-a100", "torchtitan-h100-2412")
    chosen = [r for r in runs if r.source in sources and not r.excluded]
    before = v._fitted_state()
    result = v.leave_source_out(chosen)
    assert v._fitted_state() == before
    assert result["not_judged"] == ["torchtitan-h100-2412"]
    assert result["rows"] == 19 and set(result["per_source"]) == set(sources[:2])
    narayanan = result["per_source"]["narayanan2021"]
    assert (narayanan["rows"], narayanan["fit_rows"]) == (14, 3)
    assert narayanan["refit_without_it"] != pytest.approx(narayanan["refit_with_it"], abs=1e-6)
    assert result["leave_source_out_mean"] == pytest.approx(LEAVE_SOURCE_OUT_SMALL, abs=1e-9)
