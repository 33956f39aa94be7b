"""The planner's memory per GPU (fourd.plan.memory) term by term, against figures worked out by hand
from docs/planner.md's formulas, in one process (fast):

- ZeRO's bytes per parameter, each of the three, at every stage and both precisions;
- each pipeline stage's parameters: its layers, the embedding on the first, the output and the final
  norm on the last (an RMSNorm's weight, or a LayerNorm's weight and bias);
- the ranks that can peak: the last, and the first with each layer count;
- the microbatches in flight of every schedule, the interleaved one against fourd.schedules' lists;
- one GPU of each pipeline rank of a ZeRO-3 job with full recomputation: weights, gradients, Adam,
  activations, logits, FSDP's gathered layers, the embedding and output on the edges, the
  allocator's cache, the runtime's reserve; the same model on a CPU without ZeRO;
- the edges: a tp that divides nothing, an embedding smaller than a layer, 300 pipeline ranks, names
  read from a file (new strings, not the literals).
"""

from __future__ import annotations

import dataclasses

import pytest

from fourd.layout import Layout, Parallelism
from fourd.model.config import ModelConfig
from fourd.plan.block import traffic
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job
from fourd.plan.memory import (
    Memory,
    in_flight,
    max_rank_params,
    peak_memory,
    rank_memories,
    rank_shapes,
    stage_params,
    state_bytes_per_param,
)
from fourd.schedules import build_schedule

# 10 layers of 46,208 parameters (q, k and v, o: 3 · 4,096; w1, w2, w3: 3 · 64 · 176; norms: 128),
# an embedding of 2,049 · 64 = 131,136: over twice a layer, so ZeRO-3 gathers more on the edges;
# an odd vocabulary, so the embedding and the final norm's 64 share no bit
MODEL = ModelConfig(layers=10, dim=64, ffn=176, heads=4, kv_heads=2, vocab=2049)
LAYER, EMBEDDING = 46_208, 131_136
H100 = load_cluster("dgx-h100")  # 2 GB reserved per GPU for the runtime


def test_zero_bytes_per_parameter_each_of_weights_gradients_and_adam():
    """Mixed precision 2 + 2 + 12, FP32 4 + 4 + 8; ZeRO 1 shards Adam, 2 the gradients too, 3 the
    weights too (Rajbhandari et al. 2020 §5), here over 4 ranks."""
    assert [state_bytes_per_param(zero, 4) for zero in range(4)] == [
        (2, 2, 12),
        (2, 2, 3),
        (2, 0.5, 3),
        (0.5, 0.5, 3),
    ]
    assert [state_bytes_per_param(zero, 4, dtype_bytes=4) for zero in range(4)] == [
        (4, 4, 8),
        (4, 4, 2),
        (4, 1, 2),
        (1, 1, 2),
    ]


def test_each_stack_holds_its_gradients_in_its_own_bytes():
    """Megatron's main_grad buffer in FP32: 2 + 4 + 12 = 18 B a parameter, 6 + 12/d with the
    distributed optimizer (Megatron-LM's docs/source/distrib_optimizer.md); NeMo's in BF16, as the
    weights; nanotron's BF16 gradients and their FP32 accumulators, 2 + 4; FSDP's and DeepSpeed's
    (without its pipeline engine) as the weights."""
    par = Parallelism(layout=Layout(1, 1, 1, 4), microbatches=2)
    bytes_by_stack = {}
    for stack in ("megatron-core", "megatron-lm", "nemo", "nanotron", "fsdp", "deepspeed"):
        for zero in (0, 1):
            job = Job(MODEL, H100, dataclasses.replace(par, zero=zero), 256, 8, stack=stack)
            bytes_by_stack[stack, zero] = (
                job.grad_bytes,
                sum(state_bytes_per_param(zero, 4, job.state_dtype_bytes, job.grad_bytes)),
            )
    assert bytes_by_stack["megatron-core", 0] == bytes_by_stack["megatron-lm", 0] == (4, 18)
    assert bytes_by_stack["megatron-core", 1] == (4, 6 + 12 / 4)
    assert bytes_by_stack["nemo", 0] == (2, 16) and bytes_by_stack["nemo", 1] == (2, 4 + 12 / 4)
    assert bytes_by_stack["nanotron", 0] == (6, 20)
    assert bytes_by_stack["fsdp", 0] == (2, 16)  # as its weights
    assert bytes_by_stack["deepspeed", 1] == (2, 4 + 12 / 4)  # no pipeline: no engine's copies
    megatron = Job(MODEL, H100, par, 256, 8, stack="megatron-core")
    nemo = Job(MODEL, H100, par, 256, 8, stack="nemo")
    held = peak_memory(megatron)[1].grads - peak_memory(nemo)[1].grads
    assert held == pytest.approx(2 * (10 * LAYER + 2 * EMBEDDING + 64), rel=1e-12)


def test_a_stage_holds_its_layers_and_the_edges_their_embedding_output_and_norm():
    counts = [2, 3, 3, 2]
    assert [stage_params(MODEL, counts, stage) for stage in range(4)] == [
        2 * LAYER + EMBEDDING,
        3 * LAYER,
        3 * LAYER,
        2 * LAYER + EMBEDDING + 64,  # the output projection and the final RMSNorm's weight
    ]
    # one stage holds both edges; a GPT-style model's final LayerNorm has a weight and a bias
    assert stage_params(MODEL, [10], 0) == 10 * LAYER + 2 * EMBEDDING + 64
    gelu = dataclasses.replace(MODEL, mlp="gelu")
    gelu_layer = 3 * 4_096 + 2 * 64 * 176 + 4 * 64  # two matrices, two LayerNorms with biases
    assert gelu.layer_params() == gelu_layer
    assert stage_params(gelu, [5, 5], 1) == 5 * gelu_layer + EMBEDDING + 2 * 64


def test_the_last_of_more_than_256_stages_holds_the_output():
    """CPython keeps one object per int only up to 256: the last stage is found by value."""
    counts = [1] * 300
    assert stage_params(MODEL, counts, 299) == LAYER + EMBEDDING + 64
    assert stage_params(MODEL, counts, 298) == LAYER


def test_the_ranks_that_can_peak_are_the_last_and_the_first_with_each_layer_count():
    layers, params, peaks = rank_shapes(MODEL, 4, 1)
    assert layers == (2, 3, 3, 2)
    assert params == (2 * LAYER + EMBEDDING, 3 * LAYER, 3 * LAYER, 2 * LAYER + EMBEDDING + 64)
    assert peaks == (0, 1, 3)  # rank 2 holds fewer microbatches than rank 1 with the same layers
    # two virtual stages: stages [1, 2, 1, 1], rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    small = dataclasses.replace(MODEL, layers=5)
    assert rank_shapes(small, 2, 2) == (
        (2, 3),
        (2 * LAYER + EMBEDDING, 3 * LAYER + EMBEDDING + 64),
        (0, 1),
    )
    assert max_rank_params(MODEL, 4, 1, 2) == (2 * LAYER + EMBEDDING + 64) / 2
    assert max_rank_params(MODEL, 4, 1, 5) == 44_723.2  # 223,616 / 5, not rounded down


def test_microbatches_in_flight_of_each_schedule():
    assert [in_flight("gpipe", 4, 6, 1, r) for r in range(4)] == [6, 6, 6, 6]
    assert [in_flight("1f1b", 4, 3, 1, r) for r in range(4)] == [3, 3, 2, 1]
    assert [in_flight("zero-bubble", 4, m, 1, 0) for m in (3, 8)] == [3, 4]
    # interleaved, pp = 4, V = 2: min(m·V, (V − 1)·⌈m / rounds⌉ + 2(p − r − 1) + 1) / V with
    # rounds = max(1, m // p); m = 4: (4 + 2(3 − r) + 1) / 2, the first two ranks all 8 chunks
    assert [in_flight("interleaved", 4, 4, 2, r) for r in range(4)] == [4, 4, 3.5, 2.5]
    # m = 8, two rounds of 4: (4 + 6 + 1) / 2 at rank 0; m = 6, one round of 6: rank 0 all 12
    assert [in_flight("interleaved", 4, 8, 2, r) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert [in_flight("interleaved", 4, 6, 2, r) for r in range(4)] == [6, 5.5, 4.5, 3.5]
    # m = 2 < p: one round; the first ranks hold both microbatches of both chunks
    assert [in_flight("interleaved", 4, 2, 2, r) for r in range(4)] == [2, 2, 2, 1.5]
    # m = 9: two rounds, the first of ⌈9 / 2⌉ = 5
    assert [in_flight("interleaved", 4, 9, 2, r) for r in range(4)] == [6, 5, 4, 3]


@pytest.mark.parametrize(
    "name,virtual", [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved", 2)]
)
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_in_flight_is_the_peak_of_the_schedules_own_lists(name, virtual, pp):
    for m in (1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 2):
        sched = build_schedule(name, pp, m, virtual)
        assert [in_flight(name, pp, m, virtual, r) for r in range(pp)] == [
            sched.peak_in_flight(r) / virtual for r in range(pp)
        ], m


def test_names_read_from_a_file_are_matched_by_value():
    """A schedule, recomputation or MLP named in a TOML file or on the command line is a new
    string, not the literal."""
    gpipe, one_f_one_b = "".join(["gp", "ipe"]), "".join(["1f", "1b"])
    assert [in_flight(gpipe, 4, 6, 1, 3), in_flight(one_f_one_b, 4, 6, 1, 0)] == [6, 4]
    swiglu = dataclasses.replace(MODEL, mlp="".join(["swi", "glu"]))
    assert stage_params(swiglu, [10], 0) == 10 * LAYER + 2 * EMBEDDING + 64
    full = "".join(["fu", "ll"])
    assert (
        rank_memories(_job(H100, zero=3, recompute=full), [1])[0]
        == rank_memories(_job(H100, zero=3, recompute="full"), [1])[0]
    )


def test_a_memory_adds_its_tensors_then_the_cache_and_the_reserve():
    memory = Memory(1.5e9, 2e9, 3e9, 4e9, 5e9, fragmentation=6e9, reserve=7e9)
    assert memory.total == 15.5e9
    assert memory.held == 28.5e9
    # the allocator gives back its cache before it fails: tensors and reserve must fit, no more
    assert memory.fits(22.5e9) and memory.fits(80e9) and not memory.fits(22.5e9 - 1)
    assert memory.gb() == {
        "params": 1.5,
        "grads": 2.0,
        "optimizer": 3.0,
        "activations": 4.0,
        "other": 5.0,
        "fragmentation": 6.0,
        "reserve": 7.0,
        "total": 15.5,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        memory.params = 0.0  # type: ignore[misc]


def _job(cluster, **par) -> Job:
    """MODEL at tp = 2, pp = 4, dp = 2, four microbatches of two 64-token sequences (16 a step)."""
    layout = Layout(tp=2, pp=4, dp=2)
    return Job(MODEL, cluster, Parallelism(layout=layout, microbatches=4, **par), 64, 16)


@pytest.mark.parametrize("recompute", ["none", "selective", "per-op", "full"])
def test_a_recomputed_layer_holds_what_its_recomputation_redoes_while_it_runs_backward(recompute):
    """Beside every layer's kept activations, the layer in its backward holds the activations its
    recomputation made again, one microbatch's: what it would keep without recomputation, less what it kept
    (a middle pipeline rank, ZeRO 0, no autocast: nothing else is in `other`)."""
    job = _job(H100, zero=0, recompute=recompute)
    work = job.work
    redone = traffic(dataclasses.replace(work, recompute="none")).saved - traffic(work).saved
    assert (redone > 0) == (recompute != "none")
    assert rank_memories(job, [1])[0].other == pytest.approx(128 * redone, rel=1e-12)


def test_each_rank_of_a_zero3_job_with_full_recomputation_term_by_term():
    job = _job(H100, zero=3, recompute="full")
    work = job.work
    assert work.tokens == 128 and job.dtype_bytes == 2
    layers = (2, 3, 3, 2)
    mine = [p / 2 for p in rank_shapes(MODEL, 4, 1)[1]]  # a rank's stage, cut by tp = 2
    # ZeRO-3 over the dp = 2 ranks: 1 B of weights, 1 of gradients, 6 of Adam per parameter
    per_layer = 128 * traffic(work).saved  # the layer's input, one microbatch
    # a layer recomputed holds all it keeps without recomputation, one microbatch, beyond the input it kept
    recomputing = 128 * (
        traffic(dataclasses.replace(work, recompute="none")).saved - traffic(work).saved
    )
    logits = 10 * 128 * 2049 / 2  # the loss's 10 B per logit (FP32 log-probs and grad, BF16 cast)
    gathered = 2 * LAYER / 2 * 2  # two BF16 layers, cut by tp
    edge = 2 * (EMBEDDING - LAYER) / 2 * 2  # the embedding (first) or output (last), beyond them
    other = [
        recomputing + gathered + edge,
        recomputing + gathered,
        recomputing + gathered,
        recomputing + logits + gathered + edge,
    ]
    memories = rank_memories(job, range(4))
    for rank, memory in enumerate(memories):
        acts = (4 - rank) * layers[rank] * per_layer  # 1F1B: p − r microbatches in flight
        assert (memory.params, memory.grads, memory.optimizer) == (
            mine[rank],
            mine[rank],
            6 * mine[rank],
        )
        assert memory.activations == pytest.approx(acts, rel=1e-12)
        assert memory.other == pytest.approx(other[rank], rel=1e-12), rank
        assert memory.fragmentation == pytest.approx(
            0.1952 * (8 * mine[rank] + acts + other[rank]), rel=1e-12
        )
        assert memory.reserve == 2e9
    totals = [memory.total for memory in memories]
    assert peak_memory(job) == (totals.index(max(totals)), memories[totals.index(max(totals))])


def test_a_cpu_rank_without_zero_or_recomputation_keeps_no_cache_nor_gathered_layers():
    cpu = dataclasses.replace(H100, node=dataclasses.replace(H100.node, concurrent_ranks=8))
    job = _job(cpu, zero=0)
    work = job.work
    mine = [p / 2 for p in rank_shapes(MODEL, 4, 1)[1]]
    per_layer = 128 * traffic(work).saved
    memories = rank_memories(job, (0, 3))
    for rank, memory in zip((0, 3), memories):
        assert (memory.params, memory.grads, memory.optimizer) == (
            2 * mine[rank],
            2 * mine[rank],
            12 * mine[rank],
        )
        assert memory.activations == (4 - rank) * 2 * per_layer
        assert memory.fragmentation == 0.0  # a CPU's allocator returns what is freed
    assert memories[0].other == 0.0
    assert memories[1].other == 10 * 128 * 2049 / 2  # the logits only


def test_a_tp_degree_that_divides_nothing_leaves_fractions():
    """tp = 3 over 3 heads of 16 on a 64-wide model: a layer's 46,208 parameters, the rank's
    220,864, what the 1,003 · 64 embedding holds beyond a layer and the logits of 64 tokens are
    not multiples of 3. One pipeline rank: the first and the last."""
    model = ModelConfig(layers=2, dim=64, ffn=176, heads=3, kv_heads=3, head_dim=16, vocab=1003)
    assert (model.layer_params(), model.embedding_params()) == (LAYER, 64_192)
    job = Job(model, H100, Parallelism(layout=Layout(tp=3), zero=3), 64, 1)
    (memory,) = rank_memories(job, [0])
    mine = (2 * LAYER + 2 * 64_192 + 64) / 3
    # ZeRO-3 over one rank, BF16 autocast over FP32 weights: FP32 weights and gradients and Adam's
    # two FP32 moments, 4 + 4 + 8 bytes per parameter
    assert job.work.autocast
    assert (memory.params, memory.grads, memory.optimizer) == (4 * mine, 4 * mine, 8 * mine)
    logits = 10 * 64 * 1003 / 3
    gathered = 2 * LAYER / 3 * 2
    edge = 2 * (64_192 - LAYER) / 3 * 2
    # BF16 autocast over FP32 weights: a BF16 copy of both layers' matrices (a layer less its two
    # norms) and of the output projection
    copies = 2 * (2 * (LAYER - 2 * 64) + 64_192) / 3
    assert memory.other == pytest.approx(logits + gathered + edge + copies, rel=1e-12)


def test_an_embedding_smaller_than_a_layer_gathers_nothing_more_on_the_edges():
    """ZeRO-3 gathers two layers; the embedding (first rank) and output (last) add only what they
    hold beyond a layer: nothing for a 256-token vocabulary of 64-wide vectors."""
    model = dataclasses.replace(MODEL, vocab=256)
    job = Job(model, H100, Parallelism(layout=Layout(pp=4, dp=2), zero=3, microbatches=4), 64, 16)
    assert [memory.other for memory in rank_memories(job, (0, 1))] == [2 * LAYER * 2] * 2


def test_the_last_of_300_pipeline_ranks_holds_the_logits():
    """298 layers on 300 ranks: the first holds the embedding, the last the output and its
    logits, one layer each between (ranks past 256 are found by value)."""
    model = dataclasses.replace(MODEL, layers=298)
    job = Job(model, H100, Parallelism(layout=Layout(pp=300), zero=0, microbatches=300), 64, 300)
    last, before = rank_memories(job, (299, 298))
    # and autocast's BF16 copies of their matrices: the output projection's, one layer's
    assert (last.other, before.other) == (10 * 64 * 2049 + 2 * EMBEDDING, 2 * (LAYER - 2 * 64))
