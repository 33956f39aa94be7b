"""The one resolver of planner requests (fourd.plan.request): parsing, defaults, pre-checks, and the entry
points the trainer calls."""

import argparse

import pytest

from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism
from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.memory import GB, peak_memory

H100 = load_cluster("llama3-h100")


def test_counts_and_bounds():
    assert (
        request.count("16M") == 2**24
        and request.count("15.6T") == 15.6e12
        and request.count("4e6") == 4e6
    )
    for bad in ("-5T", "0", "nan", "inf", "x"):
        with pytest.raises(request.BadValue):
            request.count(bad)
    parse = request.bounded(int, 1, 8)
    assert parse("8") == 8
    with pytest.raises(
        argparse.ArgumentTypeError, match="9 is out of range: give a whole number from 1 to 8"
    ):
        parse("9")


def test_the_cli_the_lab_and_the_trainer_resolve_alike():
    model = get_preset("llama3-405b")
    text = {
        "gpus": "8192",
        "layout": "tp=8,pp=16,dp=64",
        "seq": "8192",
        "schedule": "interleaved",
        "zero": "1",
    }
    typed = {
        "gpus": 8192,
        "layout": Layout(8, 1, 16, 64),
        "seq": 8192,
        "schedule": "interleaved",
        "zero": 1,
    }
    a = request.plans(request.resolve(model, H100, text))[0]
    b = request.best_plan(
        model, H100, 8192, 8192, 2048, {k: v for k, v in typed.items() if k not in ("gpus", "seq")}
    )
    assert a.job == b.job and a.step == b.step
    assert a.chosen == ("virtual stages", "microbatches", "recompute", "compile")
    assert isinstance(b.config, Parallelism) and b.config.sequence_parallel is True


def test_a_cpu_profile_defaults_to_what_fourd_train_runs_in_every_caller(tmp_path):
    from fourd.config import DataSection, ParallelSection, TrainSection

    path = tmp_path / "cpu.toml"
    path.write_text(
        'dtype = "fp32"\n[gpu]\nname = "CPU"\npeak_tflops = 0.05\nmemory_gb = 16.0\nhbm_bw_gbps = 10.0\n'
        "[node]\ngpus = 8\nintra_bw_gbps = 1.0\nconcurrent_ranks = 2\n[network]\nnic_bw_gbps = 1.0\n"
    )
    req = request.resolve(get_preset("small"), load_cluster(str(path)), {"layout": "tp=2"})
    assert (req.base.seq, req.base.global_seqs) == (
        DataSection().seq_len,
        TrainSection().global_batch,
    )
    assert req.fixed["sequence_parallel"] is ParallelSection().sequence_parallel


@pytest.mark.parametrize(
    "values,message",
    [
        ({"gpus": 8, "typo": 1}, "unknown planner setting(s) typo"),
        ({"gpus": 0}, "gpus 0 is out of range: give a whole number from 1 to 1,048,576"),
        ({"gpus": 8, "zero": 4}, "zero '4': choose one of 0, 1, 2, 3"),
        (
            {"gpus": 8, "schedule": "2f2b"},
            "schedule '2f2b': choose one of gpipe, 1f1b, interleaved, zero-bubble",
        ),
        ({}, "give the number of GPUs or a layout (its product is the number of GPUs)"),
        (
            {"layout": "tp=8,pp=2", "virtual_stages": 200},
            "pp=2 with 200 virtual stages makes 400 pipeline stages",
        ),
    ],
)
def test_bad_requests_name_the_setting(values, message):
    with pytest.raises(FourdError) as e:
        request.resolve(get_preset("llama3-405b"), H100, values)
    assert str(e.value).startswith(message)


def test_a_batch_in_tokens_is_planned_at_the_nearest_share_of_the_pinned_replicas(capsys):
    model, values = get_preset("llama3-405b"), {"layout": "tp=8,pp=8,dp=96", "seq": 8192}
    assert (
        request.resolve(model, load_cluster("dgx-h100"), values).base.global_seqs == 2016
    )  # 21 per replica
    assert capsys.readouterr().err == (
        "fourd: note: 2048 sequences do not split into 96 equal parts: planned with 2016\n"
    )
    req = request.resolve(
        model, load_cluster("dgx-h100"), {**values, "global_batch_tokens": 2016 * 8192}
    )
    assert req.base.global_seqs == 2016 and "global batch" not in " ".join(req.open)
    assert capsys.readouterr().err == ""
    few = {
        "layout": "tp=1,pp=1,dp=16384",
        "seq": 8192,
    }  # 2048 sequences cannot give 16,384 replicas one each
    with pytest.raises(
        FourdError, match="2048 sequences does not split into dp × microbatches = 16384 × 1"
    ):
        request.resolve(get_preset("llama3-8b"), load_cluster("dgx-h100"), few)
    # an exact batch in sequences (as fourd train gives it) is never changed
    with pytest.raises(FourdError, match="does not split into dp × microbatches = 96 × 1"):
        request.best_plan(model, "dgx-h100", 6144, 8192, 2048, {"layout": "tp=8,pp=8,dp=96"})


def test_rank_peak_memory_is_the_fullest_gpu_with_the_reserve():
    model = get_preset("llama3-8b")
    par = Parallelism(
        layout=Layout(tp=2, pp=2, dp=2),
        schedule="1f1b",
        microbatches=4,
        zero=2,
        sequence_parallel=True,
    )
    gb = request.rank_peak_memory_gb(model, "dgx-h100", par, 8192, 16)
    memory = peak_memory(Job(model, load_cluster("dgx-h100"), par, 8192, 16))[1]
    assert gb == (memory.total + memory.fragmentation + memory.reserve) / GB
    with pytest.raises(FourdError, match="tp=3 cannot cut"):
        request.rank_peak_memory_gb(model, "dgx-h100", Parallelism(layout=Layout(tp=3)), 8192, 16)
