"""The step-time model's parts on one layer, one stage and one step worked out by hand from the kernel
times they are made of (fourd/plan/perf.py): materialized attention, what each recomputation adds to the
backward, the CPU time of TP and FSDP, the embedding and the head, the slowest pipeline rank, the
pipeline send, and the data-parallel traffic each ZeRO stage leaves exposed. The suite's rows pin the
sum of these; each test here names one term, so a bug in it fails a test that says where."""

import dataclasses

import pytest

from fourd.layout import Layout, Parallelism
from fourd.model.config import ModelConfig, get_preset
from fourd.plan import request
from fourd.plan.block import matmuls, traffic
from fourd.plan.cluster import (
    AttentionSample,
    GemmSample,
    Group,
    load_cluster,
    placement,
    replica_group,
    shard_group,
)
from fourd.plan.job import Job, Work
from fourd.plan.kernels import (
    attention_time,
    collective_time,
    elementwise_time,
    gemm_time,
    optimizer_time,
)
from fourd.plan.memory import max_rank_params, stage_params
from fourd.plan.perf import (
    GRAD_ACCUMULATE_BYTES,
    OVERLAP_SLOWDOWN,
    StageTime,
    _dp_exposure,
    bubble_time,
    compute_share,
    exposed_layer_comm,
    fill_and_drain_saving,
    layer_comm,
    layer_gemms,
    layer_time,
    materialized_attention,
    overlapped,
    p2p_time,
    sharding_copies,
    slowest_rank,
    sp_collectives,
    stage_time,
    step_time,
    tied_embedding_sync,
)
from fourd.plan.stack import PRESET_DIR

H100 = load_cluster("dgx-h100")
MODEL = get_preset("llama3-8b")
SEQ = 4096
TP2 = Layout(tp=2)


def _work(layout: Layout = TP2, **changes) -> Work:
    base = Work(
        model=MODEL,
        cluster=H100,
        layout=layout,
        seq=SEQ,
        micro_seqs=2,
        recompute="none",
        sequence_parallel=True,
        dtype_bytes=2,
        fused=False,
    )
    return dataclasses.replace(base, **changes)


def _close(got: float, want: float) -> None:
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_materialized_attention_is_two_batched_gemms_forward_four_backward_and_the_scores_bytes():
    work = _work(attention="materialized")
    rows = 2 * (MODEL.heads // 2) * SEQ  # sequences × heads on this TP rank × queries
    scores = gemm_time(rows, SEQ, MODEL.head_dim, H100, 2)  # Q·Kᵀ
    values = gemm_time(rows, MODEL.head_dim, SEQ, H100, 2)  # P·V
    pairs = rows * SEQ
    forward, backward = materialized_attention(work)
    _close(forward, scores + values + elementwise_time(9 * pairs, H100))
    _close(backward, scores + 3 * values + elementwise_time(11 * pairs, H100))


def _redo_bytes(work: Work) -> float:
    """The memory-bound bytes a layer's backward runs, recomputation's included."""
    per_token = traffic(work)
    return elementwise_time(work.tokens * (per_token.backward + per_token.redo), work.cluster)


def test_selective_recomputation_redoes_the_materialized_attention_core_and_no_flash_kernel():
    for attention in ("materialized", "flash"):
        none = _work(attention=attention)
        selective = _work(attention=attention, recompute="selective")
        core = materialized_attention(none)[0] if attention == "materialized" else 0.0
        extra = _redo_bytes(selective) - _redo_bytes(none)
        _close(layer_time(selective).input_grad_s, layer_time(none).input_grad_s + core + extra)
        assert layer_time(selective).forward_s == layer_time(none).forward_s


def test_per_op_recomputation_redoes_every_other_matmuls_forward_in_the_backward():
    none, per_op = _work(), _work(recompute="per-op")
    redone = sum(gemm_time(none.tokens, out_dim, k, H100, 2) for out_dim, k in matmuls(none)[1::2])
    assert redone > 0 and len(matmuls(none)[1::2]) == len(matmuls(none)) // 2
    extra = _redo_bytes(per_op) - _redo_bytes(none)
    _close(layer_time(per_op).input_grad_s, layer_time(none).input_grad_s + redone + extra)


def test_full_recomputation_adds_the_whole_forward_to_the_backward():
    none, full = layer_time(_work()), layer_time(_work(recompute="full"))
    extra = _redo_bytes(_work(recompute="full")) - _redo_bytes(_work())
    _close(full.input_grad_s, none.input_grad_s + none.forward_s + extra)
    _close(full.backward_comm_s, none.backward_comm_s + none.forward_comm_s)


def test_a_profiles_tp_and_fsdp_cpu_time_goes_a_third_to_the_forward_two_thirds_to_the_backward():
    measured = dataclasses.replace(
        H100, gpu=dataclasses.replace(H100.gpu, tp_layer_us=900.0, fsdp_layer_us=600.0)
    )
    for layout, fsdp, added_us in (
        (Layout(tp=2), False, 900.0),
        (Layout(tp=1, dp=2), True, 600.0),
        (Layout(tp=2, dp=2), True, 1500.0),
        (Layout(tp=1, dp=2), False, 0.0),
    ):
        plain = layer_time(_work(layout, fsdp=fsdp))
        with_cpu = layer_time(_work(layout, fsdp=fsdp, cluster=measured))
        _close(with_cpu.forward_s, plain.forward_s + added_us * 1e-6 / 3)
        _close(with_cpu.input_grad_s, plain.input_grad_s + added_us * 2e-6 / 3)
        assert with_cpu.weight_grad_s == plain.weight_grad_s


def test_the_first_stage_adds_the_vocabulary_parallel_lookup():
    for sp in (True, False):
        work = _work(sequence_parallel=sp)
        act = work.tokens * MODEL.dim * 2
        tp = placement(work.layout)["tp"]
        if sp:  # partial rows reduce-scattered into the SP shard, the gradient gathered back
            comm = (
                collective_time("reduce_scatter", act, tp, H100),
                collective_time("all_gather", act, tp, H100),
            )
        else:  # all-reduced forward, nothing backward
            comm = (collective_time("all_reduce", act, tp, H100), 0.0)
        lookup = StageTime(elementwise_time(act, H100), elementwise_time(2 * act, H100), 0.0, *comm)
        assert stage_time(work, 0, first=True) == lookup
        assert stage_time(work, 3, first=True) == layer_time(work).scaled(3) + lookup


def test_the_last_stage_adds_the_norm_output_projection_and_cross_entropy():
    tokens, dim, shard = 2 * SEQ, MODEL.dim, MODEL.vocab // 2
    logits = tokens * shard
    for sp in (True, False):
        work = _work(sequence_parallel=sp)
        tp = placement(work.layout)["tp"]
        act = tokens * dim * 2
        norm = 4 * dim * 2 * tokens / (2 if sp else 1)  # the final RMSNorm's bytes, SP-sharded
        forward = gemm_time(tokens, shard, dim, H100, 2) + elementwise_time(
            norm + 18 * logits, H100
        )  # BF16 logits: 18 B each forward (cast, log-softmax), 22 backward
        input_grad = gemm_time(tokens, dim, shard, H100, 2) + elementwise_time(
            2 * norm + 22 * logits, H100
        )
        weight_grad = gemm_time(dim, shard, tokens, H100, 2)
        loss = collective_time("all_reduce", 12 * tokens, tp, H100)  # max, sum, target: FP32
        if sp:
            comm = (collective_time("all_gather", act, tp, H100) + loss,)
            comm += (collective_time("reduce_scatter", act, tp, H100),)
        else:
            comm = (loss, collective_time("all_reduce", act, tp, H100))
        head = StageTime(forward, input_grad, weight_grad, *comm)
        got = stage_time(work, 0, last=True)
        for field in ("forward_s", "input_grad_s", "weight_grad_s"):
            _close(getattr(got, field), getattr(head, field))
        _close(got.forward_comm_s, head.forward_comm_s)
        _close(got.backward_comm_s, head.backward_comm_s)


def test_the_slowest_of_four_pipeline_ranks_is_the_last_with_the_head():
    work = _work(Layout(tp=2, pp=4))
    rank, time = slowest_rank(work, 4, 1)
    assert (rank, time) == (3, stage_time(work, MODEL.layers // 4, False, True))


# 10 layers on 4 ranks: 2, 3, 3 and 2; the last rank's head (a vocabulary of 8,192 over a dimension of
# 256) takes longer forward than a layer, and less than a layer's forward and backward
NARROW = ModelConfig(layers=10, dim=256, ffn=1024, heads=4, kv_heads=4, vocab=8192, max_seq=SEQ)


def test_the_slowest_rank_has_the_most_forward_and_backward_not_the_most_forward():
    work = _work(Layout(pp=4), model=NARROW, micro_seqs=1, sequence_parallel=False)
    middle, last = stage_time(work, 3, False, False), stage_time(work, 2, False, True)
    assert last.forward > middle.forward
    assert middle.forward + middle.backward > last.forward + last.backward
    assert slowest_rank(work, 4, 1) == (1, middle)


def _job(
    layout: Layout,
    pipeline_comm: str = "overlapped",
    sp: bool = False,
    stack: str = "fourd",
    **par,
) -> Job:
    parallel = Parallelism(layout=layout, sequence_parallel=sp, **par)
    return Job(MODEL, H100, parallel, SEQ, 8 * layout.dp, pipeline_comm=pipeline_comm, stack=stack)


def test_a_pipeline_send_is_split_over_tp_with_sp_or_unless_overlapped_and_gathered_without_sp():
    layout = Layout(tp=2, pp=2)
    groups = placement(layout)
    for comm, sp, split, gathered in (
        ("overlapped", False, False, False),
        ("overlapped", True, True, False),
        ("synchronous", False, True, True),
        ("blocking", False, True, True),
        ("synchronous", True, True, False),
    ):
        job = _job(layout, comm, sp, microbatches=4)
        full = job.work.tokens * MODEL.dim * 2
        want = collective_time("send", full / (2 if split else 1), groups["pp"], H100)
        if gathered:
            want += collective_time("all_gather", full, groups["tp"], H100)
        _close(p2p_time(job), want)


LAYERS = 7  # buckets, one per layer: the slowest rank's layers (a count that does not divide bytes)


def _buckets(op: str, nbytes: float, group) -> float:
    return LAYERS * collective_time(op, nbytes / LAYERS, group, H100)


def _exposure(job: Job, t: StageTime, bubble: float = 0.0) -> tuple[float, float]:
    return _dp_exposure(job, t, bubble, LAYERS)


def test_zero_0_all_reduces_after_the_last_backward_and_its_last_bucket_is_exposed():
    job = _job(Layout(dp=8), zero=0, microbatches=4)
    params = max_rank_params(MODEL, 1, 1, 1)
    reduce = _buckets("all_reduce", 4 * params, shard_group(job.layout))
    hidden = StageTime(0.0, 10.0, 0.0, 0.0, 0.0)  # a backward far longer than the traffic
    assert _exposure(job, hidden) == pytest.approx((reduce / LAYERS, reduce), rel=1e-12)
    half = StageTime(0.0, reduce / 4, 0.0, 0.0, 0.0)  # with the bubble's half: covers half
    exposed, total = _exposure(job, half, bubble=reduce / 2)
    _close(exposed, reduce / 2 + reduce / LAYERS)
    _close(total, reduce)
    bare = StageTime(0.0, 0.0, 0.0, 0.0, 0.0)
    assert _exposure(job, bare) == pytest.approx((reduce, reduce), rel=1e-12)


def test_the_input_embeddings_gradients_reduce_after_the_backward_that_computes_them_last():
    """A rank whose input embedding holds more of its gradients than a bucket: the backward computes
    the embedding's gradient last, so its share of the reduction waits for the backward's end
    (two layers of Llama 3 8B's width and a 1M-token vocabulary: the embedding 4,194 M of 8,924 M
    parameters)."""
    wide = dataclasses.replace(MODEL, layers=2, vocab=1 << 20)
    job = dataclasses.replace(_job(Layout(dp=8), zero=0, microbatches=4), model=wide)
    params = max_rank_params(wide, 1, 1, 1)
    share = wide.embedding_params() / params
    assert share > 1 / LAYERS
    reduce = _buckets("all_reduce", 4 * params, shard_group(job.layout))
    hidden = StageTime(0.0, 10.0, 0.0, 0.0, 0.0)
    assert _exposure(job, hidden) == pytest.approx((share * reduce, reduce), rel=1e-12)
    # ZeRO 1 reduce-scatters the same share after the backward (NeMo gathers beside the forward
    # and reduces its gradients in BF16)
    zero1 = dataclasses.replace(
        _job(Layout(dp=8), zero=1, microbatches=4, stack="nemo"), model=wide
    )
    scatter = _buckets("reduce_scatter", 2 * params, shard_group(job.layout))
    gather = _buckets("all_gather", 2 * params, shard_group(job.layout))
    hidden_both = StageTime(10.0, 10.0, 0.0, 0.0, 0.0)
    _close(_exposure(zero1, hidden_both)[0], share * scatter + gather / LAYERS)


def test_a_tied_embedding_is_held_once_by_one_stage_and_synced_between_two():
    """Tied (Llama 3 8B's shape with tied=1): one stage holds the shared matrix once; across a
    pipeline the first stage holds the embedding and the last a copy for its output projection, as
    untied, and after the backward their FP32 gradients are all-reduced between a first and a last
    stage's ranks (Megatron's embedding group), exposed."""
    tied = dataclasses.replace(MODEL, tied_embeddings=True)
    embedding = MODEL.embedding_params()
    assert stage_params(tied, [32], 0) == stage_params(MODEL, [32], 0) - embedding
    for stage in (0, 1):
        assert stage_params(tied, [16, 16], stage) == stage_params(MODEL, [16, 16], stage)
    untied = _job(Layout(tp=2, pp=2), microbatches=4)
    job = dataclasses.replace(untied, model=tied)
    ends = Group(2, 2, 4)  # ranks 0 and 2: TP 2, the pipeline's two stages
    sync = collective_time("all_reduce", 4 * embedding / 2, ends, H100)
    assert sync > 0
    _close(tied_embedding_sync(job), sync)
    assert tied_embedding_sync(untied) == 0.0
    assert (
        tied_embedding_sync(
            dataclasses.replace(job, par=dataclasses.replace(job.par, layout=Layout(tp=2)))
        )
        == 0.0
    )
    _close(step_time(job).dp_exposed_s, step_time(untied).dp_exposed_s + sync)
    _close(step_time(job).step_s, step_time(untied).step_s + sync)


def test_zero_1_and_2_reduce_scatter_gradients_and_gather_the_weights_once():
    """Beside the next forward (nemo: Megatron's --overlap-param-gather) or, where the stack
    gathers inside the optimizer's step (DeepSpeed's stages 1 and 2), all of it exposed. NeMo's
    performance recipes reduce BF16 gradients, DeepSpeed FP32 ones."""
    params, group = max_rank_params(MODEL, 1, 1, 1), shard_group(Layout(dp=8))
    gather = _buckets("all_gather", 2 * params, group)  # BF16 weights
    for stack, grad_bytes, gathered_beside_forward in (("nemo", 2, True), ("deepspeed", 4, False)):
        job1 = _job(Layout(dp=8), zero=1, microbatches=4, stack=stack)
        job2 = dataclasses.replace(job1, par=dataclasses.replace(job1.par, zero=2))
        scatter = _buckets("reduce_scatter", grad_bytes * params, group)
        t = StageTime(gather / 2, scatter / 2, 0.0, 0.0, 0.0)
        gather_exposed = gather / 2 + gather / LAYERS if gathered_beside_forward else gather
        exposed, total = _exposure(job1, t)
        _close(total, scatter + gather)
        _close(exposed, scatter / 2 + scatter / LAYERS + gather_exposed)
        # ZeRO 2 reduce-scatters every microbatch's gradients, each beside its own backward
        exposed, total = _exposure(job2, t)
        _close(total, 4 * scatter + gather)
        _close(exposed, 4 * scatter / 2 + scatter / LAYERS + gather_exposed)


def test_zero_3_gathers_the_weights_for_every_forward_and_backward_and_hsdp_all_reduces_shards():
    for replicas in (1, 2):
        job = _job(Layout(dp=8), zero=3, microbatches=4, hsdp_replicas=replicas)
        params, group = max_rank_params(MODEL, 1, 1, 1), shard_group(job.layout, replicas)
        scatter = _buckets("reduce_scatter", 4 * params, group)
        gather = _buckets("all_gather", 2 * params, group)
        across = _buckets(
            "all_reduce", 4 * params / group.size, replica_group(job.layout, replicas)
        )
        assert (across > 0) == (replicas > 1)
        t = StageTime(gather / 2, gather, 0.0, 0.0, 0.0)
        forward_phase, backward_phase = 4 * gather, 4 * (gather + scatter + across)
        exposed, total = _exposure(job, t)
        _close(total, forward_phase + backward_phase)
        want = (forward_phase - 4 * t.forward) + forward_phase / (LAYERS * 4)
        want += (backward_phase - 4 * t.backward) + backward_phase / (LAYERS * 4)
        _close(exposed, want)


def test_fourd_on_cpu_reduce_scatters_zero_2_gradients_once_after_the_last_microbatch():
    cpu = dataclasses.replace(H100, node=dataclasses.replace(H100.node, concurrent_ranks=2))
    job = dataclasses.replace(_job(Layout(dp=8), zero=2, microbatches=4), cluster=cpu)
    params, group = max_rank_params(MODEL, 1, 1, 1), shard_group(job.layout)
    scatter = LAYERS * collective_time("reduce_scatter", 4 * params / LAYERS, group, cpu)
    gather = LAYERS * collective_time("all_gather", 2 * params / LAYERS, group, cpu)
    assert _exposure(job, StageTime(0.0, 0.0, 0.0, 0.0, 0.0))[1] == pytest.approx(
        scatter + gather, rel=1e-12
    )


def test_a_steps_pipeline_sends_by_how_the_stack_exchanges():
    """Overlapped: warm-up and cool-down cross every boundary, 2(p·V − 1) sends; synchronous
    (Megatron) adds 2·V for each later microbatch; interleaved-overlapped (Megatron-LM since
    2023-10) is overlapped when interleaved and synchronous under 1F1B; blocking (DeepSpeed) a
    middle rank's four, two on a two-rank pipeline."""
    microbatches = 8
    for pp, virtual, comm, sends in (
        (2, 1, "overlapped", 2),
        (4, 2, "overlapped", 14),
        (4, 2, "synchronous", 14 + 4 * 7),
        (4, 2, "interleaved-overlapped", 14),
        (4, 1, "interleaved-overlapped", 6 + 2 * 7),
        (2, 1, "blocking", 2 + 2 * 7),
        (4, 1, "blocking", 6 + 4 * 7),
        (3, 1, "blocking", 4 + 4 * 7),
    ):
        schedule = "interleaved" if virtual > 1 else "1f1b"
        job = _job(
            Layout(pp=pp),
            comm,
            microbatches=microbatches,
            virtual_stages=virtual,
            schedule=schedule,
        )
        _close(step_time(job).p2p_s, sends * p2p_time(job))


def test_zero_1_hides_the_weight_gather_behind_the_forward_and_half_the_bubble():
    job = _job(Layout(dp=8), zero=1, microbatches=4, stack="nemo")
    params, group = max_rank_params(MODEL, 1, 1, 1), shard_group(job.layout)
    gather = _buckets("all_gather", 2 * params, group)
    scatter = _buckets("reduce_scatter", 2 * params, group)  # NeMo's BF16 gradients
    # a backward that hides the scatter, a forward of a tenth of the gather, a bubble of half of it
    t = StageTime(gather / 10, 2 * scatter, 0.0, 0.0, 0.0)
    exposed, _ = _exposure(job, t, bubble=gather / 2)
    _close(exposed, scatter / LAYERS + (gather - gather / 10 - gather / 4) + gather / LAYERS)


def test_attention_on_a_cpu_profile_is_causal_without_cp_and_all_pairs_with_it():
    """fourd's CP chunks take torch's explicit-mask kernel on a CPU, which computes every pair;
    without CP the causal kernel computes half of them."""
    sample = AttentionSample(
        seq=SEQ,
        head_dim=MODEL.head_dim,
        fwd_tflops=10.0,
        bwd_tflops=5.0,
        masked_fwd_tflops=4.0,
        masked_bwd_tflops=2.0,
    )
    cpu = dataclasses.replace(H100, gpu=dataclasses.replace(H100.gpu, attention=(sample,)))
    heads = MODEL.heads // 2
    for cp, causal in ((1, True), (2, False)):
        work = _work(Layout(tp=2, cp=cp), cluster=cpu)
        plain = dataclasses.replace(work, cluster=H100)
        kernel = attention_time(work.tokens, SEQ, heads, MODEL.head_dim, cpu, causal)
        ours = attention_time(work.tokens, SEQ, heads, MODEL.head_dim, H100, True)
        gemms = layer_time(work).forward_s - kernel[0]
        _close(gemms, layer_time(plain).forward_s - ours[0])


def test_cp_gathers_the_local_kv_heads_forward_and_gathers_and_scatters_them_backward():
    """Llama 3 §3.3.2: each CP rank all-gathers the K and V of its TP rank's KV heads (at least one:
    fewer KV heads than TP ranks are replicated), and reduce-scatters their gradients."""
    for model, tp, local_kv in ((MODEL, 2, 4), (dataclasses.replace(MODEL, kv_heads=2), 4, 1)):
        work = _work(Layout(tp=tp, cp=2), model=model, sequence_parallel=False)
        kv_bytes = 2 * local_kv * MODEL.head_dim * 2 * SEQ * 2  # K and V, 2 sequences, BF16
        cp = placement(work.layout)["cp"]
        gather = collective_time("all_gather", kv_bytes, cp, H100)
        scatter = collective_time("reduce_scatter", kv_bytes, cp, H100)
        comm = exposed_layer_comm(work)
        _close(comm.cp_forward, gather)
        _close(comm.cp_backward, gather + scatter)


def test_the_optimizer_steps_the_parameters_its_rank_owns():
    """ZeRO 1-3 shard the optimizer state over the data-parallel ranks; ZeRO 0 steps every
    parameter on every rank."""
    params = max_rank_params(MODEL, 1, 1, 1)
    for zero, owned in ((0, params), (1, params / 8), (2, params / 8), (3, params / 8)):
        job = _job(Layout(dp=8), zero=zero, microbatches=1)
        _close(step_time(job).optimizer_s, optimizer_time(owned, H100, 2))


def test_tp_overlap_hides_the_backwards_collectives_behind_both_gradient_gemms():
    """With TP overlap, the backward's six SP collectives (four all-gathers, two reduce-scatters) run
    beside the input- and the weight-gradient GEMMs together; only their first chunks, the
    all-gathers' 1/tp each, have nothing beside them. On NVLink the GEMMs are the longer; over a
    link a thousand times slower the collectives are, and what the GEMMs cover is their sum."""
    slow_node = dataclasses.replace(H100.node, intra_bw_gbps=H100.node.intra_bw_gbps / 1000)
    slow = dataclasses.replace(H100, node=slow_node, collectives=())
    for cluster, comm_longer in ((H100, False), (slow, True)):
        work = _work(Layout(tp=8), micro_seqs=1, tp_overlap=True, cluster=cluster)
        plain = layer_comm(work)
        _, dgrad, wgrad = layer_gemms(work)
        gather, _ = sp_collectives(work)
        assert (plain[1] > dgrad + wgrad) == comm_longer
        exposed, hidden = overlapped(plain[1], dgrad + wgrad, 2 * gather / 8 / plain[1])
        comm = exposed_layer_comm(work)
        _close(comm.tp_backward, exposed)
        _close(comm.backward_slowdown, OVERLAP_SLOWDOWN * hidden)
        assert 0 < exposed < plain[1]


def test_zero_bubbles_idle_time_is_what_the_deferred_weight_gradients_cannot_fill():
    """Zero-bubble (Qi et al. 2023): each of p − 1 warm-up slots idles for a forward, an input
    gradient and its communication less the weight gradient that fills it; none when the weight
    gradient is the longer."""
    short = StageTime(0.3, 0.4, 0.2, 0.0, 0.05)
    _close(bubble_time("zero-bubble", 2, 8, 1, short), 0.3 + 0.4 + 0.05 - 0.2)
    _close(bubble_time("zero-bubble", 4, 8, 1, short), 3 * (0.3 + 0.4 + 0.05 - 0.2))
    filled = StageTime(0.1, 0.1, 0.5, 0.0, 0.0)
    assert bubble_time("zero-bubble", 4, 8, 1, filled) == 0.0


def test_ranks_beyond_the_cores_take_turns_and_a_profile_without_gemm_samples_shares_its_peak():
    """A CPU profile of 2 cores: 4 ranks take turns, twice as slow; without measured GEMMs each
    core computes at its share of the all-core peak, so 2 busy ranks reach it exactly."""
    node = dataclasses.replace(H100.node, gpus=8, concurrent_ranks=2)
    cpu = dataclasses.replace(H100, node=node, gpu=dataclasses.replace(H100.gpu, gemm=()))
    assert compute_share(2, cpu) == 1.0
    assert compute_share(4, cpu) == 2.0
    assert compute_share(2, H100) == 1.0


def test_on_a_cpu_the_pipeline_bubble_runs_on_the_cores_the_waiting_half_leaves():
    """8 ranks on 2 cores: while half the ranks wait in warm-up and cool-down, the 4 others share
    the cores at half the crowding, so the bubble costs half its time at 8 ranks' speed."""
    node = dataclasses.replace(H100.node, gpus=8, concurrent_ranks=2)
    cpu = dataclasses.replace(H100, node=node)
    job = dataclasses.replace(_job(Layout(pp=2, dp=4), microbatches=4), cluster=cpu)
    step = step_time(job)
    whole = bubble_time("1f1b", 2, 4, 1, step.per_microbatch) - _two_rank_saving(job)
    _close(step.bubble_s, whole * cpu.core_share(4) / cpu.core_share(8))
    assert (cpu.core_share(4), cpu.core_share(8)) == (2.0, 4.0)


def _two_rank_saving(job: Job) -> float:
    """A two-rank pipeline's fill and drain through the faster rank: the slower rank's microbatch
    less the faster one's (16 layers each, the embedding on the first, the head on the last)."""
    first = stage_time(job.work, 16, first=True)
    last = stage_time(job.work, 16, last=True)
    return abs(first.forward + first.backward - last.forward - last.backward)


def test_on_a_cpu_the_pipeline_bubble_runs_on_uncrowded_cores():
    """2 ranks on 2 cores whose best single-core GEMM is 0.6 of the all-core peak: both busy, each
    computes 1.2 times slower (the cores share the memory bus and the all-core clock); in warm-up
    and cool-down one rank computes alone, at its own rate, so the bubble costs 1 / 1.2 of its time
    at the crowded rate."""
    node = dataclasses.replace(H100.node, gpus=8, concurrent_ranks=2)
    sample = GemmSample(m=256, n=256, k=256, tflops=0.6 * H100.gpu.peak_tflops)
    cpu = dataclasses.replace(H100, node=node, gpu=dataclasses.replace(H100.gpu, gemm=(sample,)))
    assert (compute_share(1, cpu), compute_share(2, cpu)) == (1.0, pytest.approx(1.2))
    job = dataclasses.replace(_job(Layout(pp=2), microbatches=4), cluster=cpu)
    step = step_time(job)
    whole = bubble_time("1f1b", 2, 4, 1, step.per_microbatch) - _two_rank_saving(job)
    _close(step.bubble_s, whole / 1.2)


def test_a_1f1b_pipeline_fills_and_drains_through_the_faster_ranks_as_the_events_do():
    """Llama 3 8B in 4 stages of 8 layers on Megatron-LM's switches, 8 microbatches of 2 sequences:
    the last stage, with the output layer and the loss, takes 0.240 s a microbatch to the others'
    0.184. The first microbatch reaches it, and the last leaves it, through the other ranks at their
    own pace: the bubble is the other ranks' microbatches, not 3 of the slowest's, and compute plus
    bubble is the step fourd sim step's events give for the same costs."""
    from fourd.schedules import build_schedule
    from fourd.sim.step import simulate, stage_costs

    values = {"layout": "pp=4,dp=1", "gpus": 4, "seq": 4096, "global_seqs": 16}
    values |= {"microbatches": 8, "schedule": "1f1b", "recompute": "none", "stack": "megatron-lm"}
    job = request.plans(request.resolve(MODEL, H100, values), top=1)[0].job
    costs = stage_costs(job, comm=False)
    busy = [cost["F"] + cost["B"] for cost in costs]
    assert busy[3] == max(busy) and busy[3] / busy[1] == pytest.approx(1.302, abs=1e-3)
    step = step_time(job)
    _close(step.bubble_s, busy[0] + busy[1] + busy[2])
    _close(step.bubble_s, 3 * busy[3] - sum(busy[3] - b for b in busy))
    events = simulate(build_schedule("1f1b", 4, 8, 1), costs)
    _close(step.compute_s + step.bubble_s, events.step_time_s)


@pytest.mark.parametrize("pp,virtual,microbatches", [(4, 2, 8), (8, 2, 4), (4, 4, 8)])
def test_an_interleaved_pipeline_fills_and_drains_through_the_faster_ranks_as_the_events_do(
    pp, virtual, microbatches
):
    """The same model interleaved, fewer microbatches than ranks included: the closed form's bubble
    at the other ranks' mean microbatch, not the slowest's, is within 0.05 % of the events' step
    (their first chunk also carries the embedding), where the slowest rank's pace was 2 to 28 %
    above it."""
    from fourd.schedules import build_schedule
    from fourd.sim.step import simulate, stage_costs

    values = {"layout": f"pp={pp},dp=1", "gpus": pp, "seq": 4096, "global_seqs": 2 * microbatches}
    values |= {"microbatches": microbatches, "schedule": "interleaved", "virtual_stages": virtual}
    values |= {"recompute": "none", "stack": "megatron-lm"}
    job = request.plans(request.resolve(MODEL, H100, values), top=1)[0].job
    events = simulate(
        build_schedule("interleaved", pp, microbatches, virtual), stage_costs(job, comm=False)
    )
    step = step_time(job)
    assert step.compute_s + step.bubble_s == pytest.approx(events.step_time_s, rel=5e-4)
    at_the_slowest = step.compute_s + step.bubble_s + fill_and_drain_saving(job)
    assert at_the_slowest / events.step_time_s > 1.015


def test_a_rank_of_one_layer_reduces_its_gradients_in_one_bucket_all_exposed():
    job = _job(Layout(dp=8), zero=0, microbatches=4)
    params = max_rank_params(MODEL, 1, 1, 1)
    reduce = collective_time("all_reduce", 4 * params, shard_group(job.layout), H100)
    hidden = StageTime(0.0, 10.0, 0.0, 0.0, 0.0)
    assert _dp_exposure(job, hidden, 0.0, 1) == pytest.approx((reduce, reduce), rel=1e-12)


def test_cpu_workers_lose_their_measured_sync_share_unless_a_pipeline_stage_takes_the_core():
    """A 2-core CPU profile that measured a sync share of 0.25 with TP's pattern and 0.125 with
    FSDP's: synchronizing ranks compute 1.25 times as long per microbatch with TP, 1.125 times
    without (the communication terms unchanged), two ranks on their own cores and four without a
    pipeline alike (every rank waits at the same layer's collectives); one rank alone does not, nor
    four ranks in two pipeline stages on the two cores (a waiting stage's core goes to the other
    stage). A profile without the FSDP figure charges TP's share to every layout."""
    node = dataclasses.replace(H100.node, gpus=8, concurrent_ranks=2)
    plain = dataclasses.replace(H100, node=node)
    synced = dataclasses.replace(
        H100, node=dataclasses.replace(node, sync_share=0.25, fsdp_sync_share=0.125)
    )
    older = dataclasses.replace(H100, node=dataclasses.replace(node, sync_share=0.25))
    for layout, cluster, share in (
        (Layout(tp=2), synced, 0.25),
        (Layout(dp=2), synced, 0.125),
        (Layout(cp=2), synced, 0.125),
        (Layout(dp=2), older, 0.25),
        (Layout(dp=1), synced, 0.0),
        (Layout(tp=2, dp=2), synced, 0.25),
        (Layout(pp=2, dp=2), synced, 0.0),
    ):
        base = step_time(dataclasses.replace(_job(layout, microbatches=2), cluster=plain))
        got = step_time(dataclasses.replace(_job(layout, microbatches=2), cluster=cluster))
        want = base.per_microbatch + base.per_microbatch.scaled(share, comm=0.0)
        for field in dataclasses.fields(StageTime):
            _close(getattr(got.per_microbatch, field.name), getattr(want, field.name))
        _close(got.tp_comm_s, base.tp_comm_s)


def test_fsdp2_copies_each_gathered_layer_out_and_each_gradient_in_on_the_compute_stream():
    """FSDP2 (`fsdp2`, fourd) copies a gather's flat output into the parameters (2 · 2 B a BF16
    weight) and a microbatch's BF16 gradients into one FP32 buffer for the reduce-scatter (2 + 4 B),
    on the compute stream: ZeRO 3 gathers before the forward and again before the backward, ZeRO 2
    once a step; on a CPU profile fourd reduces once a step. FSDP1's flat parameters (`fsdp`) copy
    nothing there, and nothing is sharded on one rank or under ZeRO 1."""
    microbatches = 4
    params = max_rank_params(MODEL, 1, 1, 1)
    copy_out = elementwise_time(4 * params, H100)
    copy_in = elementwise_time(6 * params, H100)
    zero3 = _job(Layout(dp=8), stack="fsdp2", zero=3, microbatches=microbatches)
    zero2 = _job(Layout(dp=8), stack="fsdp2", zero=2, microbatches=microbatches)
    assert sharding_copies(zero3, params) == StageTime(copy_out, 0.0, copy_out + copy_in, 0.0, 0.0)
    assert sharding_copies(zero2, params) == StageTime(copy_out / 4, 0.0, copy_in, 0.0, 0.0)
    cpu = dataclasses.replace(H100, node=dataclasses.replace(H100.node, concurrent_ranks=2))
    on_cpu = dataclasses.replace(zero3, cluster=cpu)
    _close(sharding_copies(on_cpu, params).weight_grad_s, copy_out + copy_in / 4)
    nothing = StageTime(0.0, 0.0, 0.0, 0.0, 0.0)
    for job in (
        _job(Layout(dp=8), stack="fsdp", zero=3, microbatches=microbatches),
        _job(Layout(), stack="fsdp2", zero=3, microbatches=microbatches),
        _job(Layout(dp=8), stack="fsdp2", zero=1, microbatches=microbatches),
    ):
        assert sharding_copies(job, params) == nothing
    flat = _job(Layout(dp=8), stack="fsdp", zero=3, microbatches=microbatches)
    copied = step_time(zero3).per_microbatch
    want = step_time(flat).per_microbatch + sharding_copies(zero3, params)
    for field in dataclasses.fields(StageTime):
        _close(getattr(copied, field.name), getattr(want, field.name))
    assert _job(Layout(dp=8), stack="fourd", zero=3).shards_by_parameter


def test_a_stack_that_accumulates_gradients_apart_pays_a_pass_a_microbatch(tmp_path):
    """nanotron's FP32 gradient accumulator adds each microbatch's BF16 weight gradients into FP32
    buffers after its backward: GRAD_ACCUMULATE_BYTES a parameter the rank holds, every microbatch
    (on one GPU nothing else moves with it). DeepSpeed makes the pass under its pipeline engine
    only; fourd's stack never."""
    without = tmp_path / "nanotron-fused-sum.toml"
    preset = (PRESET_DIR / "nanotron.toml").read_text()
    without.write_text(
        preset.replace("grad_accumulate_pass = true", "grad_accumulate_pass = false")
    )
    one_gpu, microbatches = Layout(), 4
    apart = _job(one_gpu, stack="nanotron", microbatches=microbatches)
    fused = _job(one_gpu, stack=str(without), microbatches=microbatches)
    assert (apart.accumulates_apart, fused.accumulates_apart) == (True, False)
    params = max_rank_params(MODEL, 1, 1, 1, apart.work.pipeline_split)
    one_pass = elementwise_time(GRAD_ACCUMULATE_BYTES * params, H100)
    _close(step_time(apart).step_s - step_time(fused).step_s, microbatches * one_pass)
    deepspeed = [
        _job(Layout(pp=pp), "blocking", stack="deepspeed", microbatches=4) for pp in (1, 2)
    ]
    assert [job.accumulates_apart for job in deepspeed] == [False, True]
    assert not _job(Layout(pp=2), stack="fourd", microbatches=4).accumulates_apart
