"""fourd.plan.job by hand: the work of one microbatch a planned run hands the time and memory models
(its sequences and tokens as whole numbers, FSDP units where ZeRO shards over more than one rank,
autocast where no data-parallel wrapper casts the weights) and the stack switches it carries
(contract: `fourd plan`)."""

import pytest

from fourd.layout import Layout, Parallelism
from fourd.model.config import get_preset
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job

MODEL = get_preset("llama3-8b")
H100 = load_cluster("dgx-h100")


def _job(layout, zero=0, precision=None, hsdp_replicas=1, **fields):
    par = Parallelism(
        layout=layout, microbatches=3, zero=zero, hsdp_replicas=hsdp_replicas, recompute="none"
    )
    return Job(MODEL, H100, par, 4096, 6 * layout.dp, precision=precision, **fields)


def test_a_microbatch_is_whole_sequences_and_whole_tokens():
    job = _job(Layout(cp=2, dp=2))
    assert (job.micro_seqs, job.work.micro_seqs) == (
        2,
        2,
    )  # 12 sequences, 2 replicas, 3 microbatches
    tokens = job.work.tokens  # a CP rank holds half of each sequence
    assert tokens == 4096 and type(tokens) is int
    assert type(job.micro_seqs) is int


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_each_layer_is_an_fsdp_unit_when_zero_shards_over_more_than_one_rank(zero):
    assert _job(Layout(dp=2), zero).work.fsdp == (zero >= 1)
    assert _job(Layout(cp=2), zero).work.fsdp == (zero >= 1)  # CP ranks share the shards too
    assert not _job(Layout(tp=2), zero).work.fsdp  # one data-parallel rank: nothing to shard
    if zero == 3:  # HSDP over 2 replicas of 2: shards of 2 ranks, still FSDP; of 4 replicas, none
        assert _job(Layout(dp=4), zero, hsdp_replicas=2).work.fsdp
        assert not _job(Layout(dp=4), zero, hsdp_replicas=4).work.fsdp


def test_bf16_autocasts_only_without_a_data_parallel_wrapper():
    """fourd alone on one data-parallel rank autocasts over FP32 weights; FSDP's and DDP's mixed
    precision (any dp or cp above 1) computes with BF16 copies instead; FP32 casts nothing."""
    assert _job(Layout(tp=2)).work.autocast
    assert not _job(Layout(dp=2)).work.autocast
    assert not _job(Layout(cp=2)).work.autocast
    assert not _job(Layout(cp=2, dp=2)).work.autocast  # cp / dp = 1, cp · dp = 4
    assert not _job(Layout(tp=2), precision="fp32").work.autocast


def test_a_jobs_switches_are_the_stacks_unless_pinned():
    nemo = _job(Layout(tp=2, dp=2), zero=1, stack="nemo")
    assert (nemo.switch("tp_overlap"), nemo.dp_overlapped, nemo.gathers_in_step) == (
        True,
        True,
        False,
    )
    assert _job(Layout(tp=2), stack="nemo", tp_overlap=False).switch("tp_overlap") is False
    assert _job(Layout(tp=2), stack="megatron-core", dp_overlap=True).dp_overlapped is True
    # the stack's gather_in_step names ZeRO stages: nanotron's 1, not its 0
    assert _job(Layout(dp=2), zero=1, stack="nanotron").gathers_in_step
    assert not _job(Layout(dp=2), zero=0, stack="nanotron").gathers_in_step
    assert [_job(Layout(dp=2), zero=z, stack="deepspeed").gathers_in_step for z in range(4)] == [
        False,
        True,
        True,
        False,
    ]
