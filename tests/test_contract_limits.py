"""Promises of `fourd train` and `fourd plan` checked at their exact edges, in one process (fast):

- every config limit (fourd.config.LIMITS) at its boundary: the last value accepted, the first refused;
- the memory check before launch multiplies a rank's need by the ranks on a CPU (they share its RAM) and
  not on GPUs (each has its own memory), fourd.train.auto.check_memory;
- the planner's ZeRO bytes honour HSDP's replica groups: the shard group is dp·cp / R.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from fourd.config import LIMITS, Config, set_value
from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism
from fourd.model.config import get_preset
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.memory import rank_memories, rank_shapes
from fourd.plan.request import rank_peak_memory_gb
from fourd.train.auto import check_memory

# Each limit as the contract's users read it in the error line, written out here by hand: a loosened or
# tightened limit (an Adam beta of exactly 1 accepted, a step count of 0 accepted) changes one of these.
WANT = {
    **{f"model.{k}": "at least 1" for k in ("layers", "dim", "ffn", "heads", "kv_heads")},
    **{f"model.{k}": "at least 1" for k in ("vocab", "max_seq")},
    "model.head_dim": "at least 2",
    "model.norm_eps": "positive",
    "model.rope_theta": "positive",
    "data.seq_len": "at least 2",
    "data.holdout_fraction": "in [0, 0.5)",
    "train.steps": "at least 1",
    "train.global_batch": "at least 1",
    "train.log_every": "at least 1",
    "train.lr": "positive",
    "train.min_lr": "at least 0",
    "train.warmup_steps": "at least 0",
    "train.weight_decay": "at least 0",
    "train.grad_clip": "positive",
    "train.beta1": "in [0, 1)",
    "train.beta2": "in [0, 1)",
    "train.seed": "in 0 .. 2^63 - 1",
    "train.timeout_s": "in (0, 1e6] seconds",
    "parallel.microbatches": "at least 1",
    "parallel.virtual_stages": "at least 1",
    "parallel.hsdp_replicas": "at least 1",
    "checkpoint.interval": "at least 0",
    "checkpoint.keep": "at least 1",
    "eval.every": "at least 0",
    "eval.batches": "at least 1",
    "run.max_restarts": "at least 0",
    "fault.kill_rank": "at least -1",
    "fault.at_step": "at least -1",
    "fault.hang_rank": "at least -1",
}


def _is_int(key: str) -> bool:
    section, name = key.split(".")
    return isinstance(getattr(getattr(Config(), section), name), int) or section == "model"


def _edges(key: str, what: str) -> tuple[list, list]:
    """(values just inside the limit, values just outside it), from the limit's words."""
    ints = _is_int(key) and key not in ("model.norm_eps", "model.rope_theta")
    below = (lambda v: v - 1) if ints else (lambda v: math.nextafter(v, -math.inf))
    above = (lambda v: v + 1) if ints else (lambda v: math.nextafter(v, math.inf))
    if m := re.fullmatch(r"at least (-?\d+)", what):
        lo = int(m.group(1))
        return [lo, above(lo)], [below(lo)]
    if what == "positive":
        tiny = math.nextafter(0.0, 1.0)
        return [tiny, 1.0], [0.0, -tiny]
    if m := re.fullmatch(r"in \[(\S+), (\S+)\)", what):
        lo, hi = float(m.group(1)), float(m.group(2))
        return [lo, below(hi)], [below(lo), hi]
    if what == "in 0 .. 2^63 - 1":
        return [0, 2**63 - 1], [-1, 2**63]
    if what == "in (0, 1e6] seconds":
        return [math.nextafter(0.0, 1.0), 1e6], [0.0, math.nextafter(1e6, math.inf)]
    raise AssertionError(f"{key}: no boundary known for the limit {what!r}")


def test_every_limit_is_the_one_written_out():
    assert {key: what for key, (_, what) in LIMITS.items()} == WANT


@pytest.mark.parametrize("key", sorted(WANT))
def test_each_limit_accepts_its_last_value_and_refuses_the_first_beyond(key):
    inside, outside = _edges(key, WANT[key])
    for value in inside:
        cfg = Config()
        set_value(cfg, key, value)
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == value, (key, value)
    for value in outside:
        with pytest.raises(FourdError) as refused:
            set_value(Config(), key, value)
        assert str(refused.value) == f"{key} = {value!r} must be {WANT[key]}", (key, value)


def test_an_adam_beta_of_exactly_one_is_refused_and_0999_accepted():
    for key in ("train.beta1", "train.beta2"):
        with pytest.raises(FourdError, match=rf"^{key} = 1.0 must be in \[0, 1\)$"):
            set_value(Config(), key, 1.0)
        cfg = Config()
        set_value(cfg, key, "0.999")
        assert getattr(cfg.train, key.split(".")[1]) == 0.999


# --- the memory check before launch ---------------------------------------------------------------------


def _cfg(layout: str) -> Config:
    cfg = Config()
    for key, value in {
        "model.preset": "debug",
        "data.seq_len": 64,
        "train.global_batch": 4,
        "parallel.layout": layout,
        "parallel.zero": 0,
    }.items():
        set_value(cfg, key, value)
    return cfg


def _cpu(cluster):
    """The same server described as a CPU machine: its ranks share the cores (and the RAM)."""
    return dataclasses.replace(
        cluster, node=dataclasses.replace(cluster.node, concurrent_ranks=cluster.node.gpus)
    )


def test_memory_check_multiplies_by_the_ranks_on_a_cpu_and_not_on_gpus():
    gpus = load_cluster("dgx-h100")
    cfg = _cfg("dp=4")
    par = Parallelism(layout=Layout(dp=4), zero=0)
    one_gpu = rank_peak_memory_gb(get_preset("debug"), gpus, par, 64, 4) * 1e9
    # GPUs: each rank has its own memory, so twice one rank's need fits whatever the rank count
    check_memory(cfg, gpus, int(2 * one_gpu))
    with pytest.raises(FourdError) as refused:
        check_memory(cfg, gpus, int(0.99 * one_gpu))
    assert str(refused.value).startswith(
        f"memory: debug at layout tp=1,cp=1,pp=1,dp=4 needs about {one_gpu / 1e9:.1f} GB, more than "
        f"{int(0.99 * one_gpu) / 1e9:.1f} GB per GPU: "
    )
    # a CPU: the 4 ranks share one RAM, so the same capacity no longer holds them
    cpu = _cpu(gpus)
    one_cpu = rank_peak_memory_gb(get_preset("debug"), cpu, par, 64, 4) * 1e9
    check_memory(cfg, cpu, int(4 * one_cpu) + 1)
    with pytest.raises(FourdError) as refused:
        check_memory(cfg, cpu, int(3.9 * one_cpu))
    assert str(refused.value).startswith(
        f"memory: debug at layout tp=1,cp=1,pp=1,dp=4 needs about {4 * one_cpu / 1e9:.1f} GB for its 4 "
        f"ranks, more than {int(3.9 * one_cpu) / 1e9:.1f} GB of RAM available: "
    )


# --- HSDP in the planner's memory -------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_planner_shards_zero3_state_over_dp_over_the_hsdp_replicas(replicas):
    """ZeRO 3 in FP32: 4 B weights, 4 B gradients, 8 B Adam moments per parameter, each divided by the ranks
    of one shard group: dp·cp / R with R HSDP replica groups (Zhao et al. 2023, PyTorch FSDP §3.2.2)."""
    model = get_preset("small")
    lay = Layout(tp=2, cp=2, pp=2, dp=4)
    par = Parallelism(layout=lay, zero=3, hsdp_replicas=replicas, microbatches=2)
    job = Job(model, load_cluster("dgx-h100"), par, 256, 16, precision="fp32")
    params = rank_shapes(model, lay.pp, 1)[1]
    shard = 2 * 4 // replicas
    for rank, memory in zip((0, 1), rank_memories(job, (0, 1))):
        mine = params[rank] / 2  # the rank's pipeline stage, cut by tp = 2
        assert (memory.params, memory.grads, memory.optimizer) == (
            4 * mine / shard,
            4 * mine / shard,
            8 * mine / shard,
        ), (replicas, rank)
