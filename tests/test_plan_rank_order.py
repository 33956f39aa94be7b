"""How a stack numbers its ranks (fourd.plan.cluster.RANK_ORDERS, a stack's `rank_order`): the groups each
parallel dimension forms, where they land on a cluster, and what that does to a step."""

import json
import subprocess
import sys

from fourd.layout import Layout, Parallelism
from fourd.model.config import parse_model_spec
from fourd.plan.cluster import (
    RANK_ORDERS,
    Group,
    group_level,
    load_cluster,
    placement,
    replica_group,
    shard_group,
)
from fourd.plan.job import Job
from fourd.plan.perf import step_time
from fourd.plan.stack import load_stack

FOURD, MEGATRON = RANK_ORDERS
# Nemotron-4 340B as the suite plans it, on two of dgx-gb200's 64-GPU NVLink domains
NEMOTRON = parse_model_spec(
    "layers=96,dim=18432,ffn=73728,heads=96,kv_heads=8,vocab=257024,mlp=gelu"
)
GB200 = load_cluster("dgx-gb200")


def nemotron(stack: str) -> Job:
    par = Parallelism(
        layout=Layout(tp=8, cp=1, pp=4, dp=4),
        schedule="interleaved",
        microbatches=8,
        virtual_stages=12,
        zero=1,
        sequence_parallel=True,
    )
    return Job(NEMOTRON, GB200, par, 4096, 32, stack=stack)


def test_each_order_gives_each_dimension_the_stride_of_the_degrees_inside_it():
    lay = Layout(tp=4, cp=2, pp=8, dp=2)
    assert placement(lay, FOURD) == {
        "tp": Group(4, 1, 128),
        "cp": Group(2, 4, 128),
        "pp": Group(8, 8, 128),
        "dp": Group(2, 64, 128),
    }
    assert placement(lay, MEGATRON) == {
        "tp": Group(4, 1, 128),
        "cp": Group(2, 4, 128),
        "pp": Group(8, 16, 128),
        "dp": Group(2, 8, 128),
    }
    assert placement(lay) == placement(lay, FOURD)


def test_the_shard_and_replica_groups_follow_the_order():
    lay = Layout(tp=2, cp=2, pp=4, dp=8)
    # cp x dp ranks: adjacent TP groups with DP inside the stage, a ring spread over the span without
    assert shard_group(lay, order=MEGATRON) == Group(16, 2, 128)
    assert shard_group(lay, order=FOURD) == Group(16, 8, 128)
    # HSDP over 2 replicas: half the cp x dp ranks shard, the same shard sits half a stage's span away
    assert shard_group(lay, 2, MEGATRON) == Group(8, 2, 128)
    assert replica_group(lay, 2, MEGATRON) == Group(2, 16, 128)
    assert replica_group(lay, 2, FOURD) == Group(2, 64, 128)
    # no data parallelism: the CP ranks alone, either way
    solo = Layout(tp=2, cp=4, pp=2, dp=1)
    assert shard_group(solo, order=MEGATRON) == shard_group(solo, order=FOURD) == Group(4, 2, 16)


def test_megatrons_data_parallel_ranks_share_an_nvlink_domain_and_its_step_hides_their_traffic():
    nemo, fourd = nemotron("nemo"), nemotron("fourd")
    assert load_stack("nemo").rank_order == MEGATRON and load_stack("fourd").rank_order == FOURD
    # 32 GPUs a replica: the 4 replicas of a stage sit 8 GPUs apart inside one 64-GPU domain, or 32
    # apart, some across two domains
    assert nemo.work.groups["dp"] == Group(4, 8, 128)
    assert group_level(shard_group(nemo.layout, order=nemo.work.rank_order), GB200) == "nvlink"
    assert group_level(shard_group(fourd.layout, order=fourd.work.rank_order), GB200) == "pod"
    # the pipeline then crosses domains instead (a rack is a domain: "pod" is between racks of a pod)
    assert group_level(nemo.work.groups["pp"], GB200) == "pod"
    assert step_time(nemo).dp_exposed_s < step_time(fourd).dp_exposed_s / 10


def test_the_report_and_json_name_the_order_and_place_each_group_by_it():
    args = [
        "--model-spec",
        "layers=96,dim=18432,ffn=73728,heads=96,kv_heads=8,vocab=257024,mlp=gelu",
        "--cluster",
        "dgx-gb200",
        "--gpus",
        "128",
        "--layout",
        "tp=8,pp=4,dp=4",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "12",
        "--seq",
        "4096",
        "--global-batch-tokens",
        str(32 * 4096),
        "--stack",
        "nemo",
    ]
    run = [sys.executable, "-m", "fourd", "plan", *args]
    out = json.loads(subprocess.run([*run, "--json"], capture_output=True, check=True).stdout)
    assert out["rank_order"] == MEGATRON
    assert (out["placement"]["dp"], out["placement"]["pp"]) == ("nvlink", "pod")
    text = subprocess.run(run, capture_output=True, check=True, text=True).stdout
    assert "Placement (ranks innermost first: TP, CP, DP, PP)" in text


def test_a_stack_file_with_an_unknown_order_is_one_line_and_exit_2(tmp_path):
    stack = tmp_path / "mine.toml"
    stack.write_text('name = "mine"\nrank_order = "dp-tp"\n')
    run = [sys.executable, "-m", "fourd", "plan", "--model", "debug", "--cluster", "dgx-h100"]
    done = subprocess.run(
        [*run, "--gpus", "8", "--stack", str(stack)], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"fourd: error: {stack}: rank_order = 'dp-tp'; allowed: tp-cp-pp-dp, tp-cp-dp-pp"
    ]
