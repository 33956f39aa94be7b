"""What the planner plans: one training job (model, cluster, how it is cut, the batch), and the work
one rank does for one microbatch. Frozen values, so the memory and time model can cache on them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from fourd.layout import Layout, Parallelism, layer_split
from fourd.model.config import ModelConfig
from fourd.plan.cluster import DTYPE_BYTES, FP8, RANK_ORDERS, Cluster, Group, placement
from fourd.plan.stack import GRAD_REDUCE_BYTES, load_stack, switch

# a fused kernel; the s × s scores written to memory and soft-maxed by a fused kernel (Megatron
# 2021-22); or by each op's own kernel (Hugging Face's eager attention)
ATTENTION = ("flash", "materialized", "eager")


@dataclass(frozen=True)
class Work:
    """One microbatch on one rank of a (TP, CP) group: everything a layer's time depends on."""

    model: ModelConfig
    cluster: Cluster
    layout: Layout
    seq: int
    micro_seqs: int
    recompute: str
    sequence_parallel: bool
    dtype_bytes: int
    fused: bool  # elementwise ops fused: torch.compile, or the stack's own kernels
    attention: str = "flash"
    autocast: bool = False  # BF16 autocast over FP32 weights: the residual stream stays FP32
    fsdp: bool = False  # each layer an FSDP unit (ZeRO 1-3 over more than one rank)
    tp_overlap: bool = False  # TP collectives in chunks beside their GEMMs (with SP only)
    shared_kv: bool = False  # attention reads each K and V head for all its query heads, uncopied
    fused_attention: str = "flash2"  # the fused attention kernel family (fourd.plan.stack)
    pipeline_split: str = "layers"  # how the stack splits layers over pipeline ranks
    fp8: bool = False  # the linear layers' GEMMs in FP8, with their casts (cluster.FP8)
    rank_order: str = RANK_ORDERS[0]  # how the stack numbers its ranks (cluster.RANK_ORDERS)
    selective: str = "elementwise"  # what selective recomputation redoes (stack.SELECTIVE_POLICIES)

    @property
    def groups(self) -> Mapping[str, Group]:
        """The group of each parallel dimension as the stack places its ranks."""
        return placement(self.layout, self.rank_order)

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch on one rank (context parallelism cuts each sequence)."""
        return self.micro_seqs * self.seq // self.layout.cp

    @property
    def recomputes_attention(self) -> bool:
        """Whether the backward runs the attention core's forward again: selective recomputation
        with materialized scores (Korthikanti et al. 2022 §5), or beside a fused kernel under a stack
        whose selective policy is "attention" (Megatron-Core's core_attn)."""
        if self.recompute != "selective":
            return False
        return self.attention != "flash" or self.selective == "attention"

    def __hash__(self) -> int:  # the time model's caches key on this: hash the fields once
        return _hash(self)


@dataclass(frozen=True)
class Job:
    """A training run: `global_seqs` sequences of `seq` tokens per optimizer step, cut as `par`
    says. `precision` None trains in the profile's precision; `compiled` runs the blocks
    torch.compile'd (fused kernels); `attention` is "flash" (a fused kernel), "materialized" (the
    s × s scores in memory, a fused softmax) or "eager" (the scores in memory, each op a kernel).
    `pipeline_comm`: "overlapped"; "synchronous", each microbatch's exchanges waited for (Megatron);
    "interleaved-overlapped", synchronous under 1F1B and overlapped under the interleaved schedule
    (Megatron-LM's training loop since 2023-10-12, NeMo; `pipeline_sends` resolves it); "blocking",
    each send waits for its receiver, each backward adds its gradients into FP32 ones by a pass of
    its own and they are reduced after the last backward (DeepSpeed's pipeline engine). `stack`
    names the software stack (fourd.plan.stack);
    `fused_kernels`, `tp_overlap`, `dp_overlap`, `shared_kv` and `fused_attention` None take the
    stack's (request.resolve also fills `pipeline_comm` from the stack)."""

    model: ModelConfig
    cluster: Cluster
    par: Parallelism
    seq: int
    global_seqs: int
    precision: str | None = None
    compiled: bool = False
    attention: str = "flash"
    pipeline_comm: str = "overlapped"
    stack: str = "fourd"
    tp_overlap: bool | None = None
    dp_overlap: bool | None = None
    fused_kernels: bool | None = None
    shared_kv: bool | None = None
    fused_attention: str | None = None

    def switch(self, name: str) -> bool:
        """The stack switch `name` (fused_kernels, tp_overlap, dp_overlap, shared_kv): as pinned,
        else the stack's."""
        return switch(load_stack(self.stack), name, getattr(self, name))

    @property
    def attention_kernel(self) -> str:
        """The fused attention kernel family that runs: as pinned, else the stack's; cuDNN's only
        where the GPU profile has its figures (Transformer Engine prefers it on Hopper alone),
        FlashAttention-2 elsewhere."""
        asked = self.fused_attention or load_stack(self.stack).fused_attention
        if asked == "cudnn" and self.cluster.gpu.cudnn_attention_fwd_efficiency is None:
            return "flash2"
        return asked

    @property
    def pipeline_sends(self) -> str:
        """How this plan's pipeline exchanges run: "overlapped", "synchronous" or "blocking", as
        `pipeline_comm` says; "interleaved-overlapped" is overlapped under the interleaved schedule
        and synchronous under the others. Megatron-LM's training loop overlaps the interleaved
        schedule's exchanges with the chunks' compute by default since 2023-10-12 (commit 4eeff55,
        `--no-overlap-p2p-communication` turns it off; `batch_p2p_comm = not overlap_p2p_comm`,
        megatron/training/arguments.py) and waits for batched ones without virtual stages; NeMo's
        MegatronCommOverlapCallback sets the same (overlap_p2p_comm with VP > 1, batch_p2p_comm
        without)."""
        if self.pipeline_comm != "interleaved-overlapped":
            return self.pipeline_comm
        interleaved = self.par.schedule == "interleaved" and self.par.virtual_stages > 1
        return "overlapped" if interleaved else "synchronous"

    @property
    def dp_overlapped(self) -> bool:
        """Data-parallel traffic beside compute."""
        return self.switch("dp_overlap")

    @property
    def gathers_in_step(self) -> bool:
        """ZeRO 1 or 2's weight all-gather inside the optimizer's step, exposed (the stack's
        `gather_in_step`), not beside the next forward."""
        return self.par.zero in load_stack(self.stack).gather_in_step

    @property
    def accumulates_apart(self) -> bool:
        """Each microbatch's BF16 weight gradients added into FP32 copies by a pass of their own:
        the stack's `grad_accumulate_pass` (nanotron), or DeepSpeed's pipeline engine (blocking
        sends, with a pipeline)."""
        engine = self.pipeline_sends == "blocking" and self.layout.pp > 1
        return load_stack(self.stack).grad_accumulate_pass or engine

    @property
    def shard_reduce(self) -> str:
        """The collective that reduces ZeRO 1 to 3's gradients to their shards: "reduce_scatter", or
        "all_reduce" where the stack reduces the whole gradients on every rank, each keeping its
        shard's (the stack's `shard_reduce`: InternEvo's Hybrid ZeRO)."""
        return load_stack(self.stack).shard_reduce

    @property
    def weight_gather(self) -> str:
        """How ZeRO 1 and 2 gather the updated weights: "all_gather", or "broadcast", each rank's
        shard broadcast on its own (the stack's `weight_gather`)."""
        return load_stack(self.stack).weight_gather

    @property
    def reduces_whole_gradients(self) -> bool:
        """ZeRO 1 to 3's gradients all-reduced whole over every rank that shares the weights, each
        rank keeping its shard's, instead of reduce-scattered (`shard_reduce = "all_reduce"`)."""
        return self.par.zero >= 1 and self.shard_reduce == "all_reduce"

    @property
    def broadcasts_weights(self) -> bool:
        """ZeRO 1 or 2's updated weights broadcast one rank's shard at a time, instead of
        all-gathered (`weight_gather = "broadcast"`)."""
        return self.par.zero in (1, 2) and self.weight_gather == "broadcast"

    @property
    def grad_bytes(self) -> int:
        """Bytes a rank holds per weight gradient before ZeRO shards it: the weights' (BF16 training:
        the gradient autograd writes), the reduction's where the stack accumulates into a buffer in
        that precision (its `main_grads`: Megatron's main_grad, FP32 unless NeMo reduces in BF16),
        or, where each microbatch's gradients are added into FP32 copies by a pass of their own
        (`accumulates_apart`: nanotron's FP32 gradient accumulator, DeepSpeed's BF16 optimizer under
        its pipeline engine), both: the BF16 gradients and their 4-byte copies."""
        weights = self.state_dtype_bytes
        if self.accumulates_apart and weights < 4:
            return weights + 4
        if load_stack(self.stack).main_grads:
            return self.grad_reduce_bytes
        return weights

    @property
    def shards_by_parameter(self) -> bool:
        """ZeRO 2 and 3 shard each parameter on its own (the stack's `sharding_copies`: FSDP2), with
        a copy after each gather and before each reduction (fourd.plan.perf.sharding_copies)."""
        return load_stack(self.stack).sharding_copies

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes of a gradient as data parallelism reduces it: the stack's `grad_reduce` precision
        (fourd.plan.stack.GRAD_REDUCE_BYTES); FP32 training reduces FP32 gradients."""
        if self.dtype_bytes == 4:
            return 4
        return GRAD_REDUCE_BYTES[load_stack(self.stack).grad_reduce]

    @property
    def bucket_params(self) -> float:
        """Parameters whose gradients fill one of the stack's DDP buckets: `dp_bucket_mb` MiB of
        them in their parameters' dtype (torch DDP's bucket_cap_mb); 0 where the stack reduces one
        layer at a time."""
        bucket_mb = load_stack(self.stack).dp_bucket_mb
        return bucket_mb * 2**20 / self.state_dtype_bytes

    def gradient_buckets(self, params: float, layers: int) -> int:
        """The data-parallel reductions of a rank's `params` gradients over its `layers` layers: one
        per DDP bucket (`bucket_params`), else one per layer."""
        if not self.bucket_params:
            return max(1, layers)
        return max(1, math.ceil(params / self.bucket_params))

    @property
    def layout(self) -> Layout:
        return self.par.layout

    @property
    def micro_seqs(self) -> int:
        """Sequences per microbatch."""
        return self.global_seqs // (self.layout.dp * self.par.microbatches)

    @property
    def fp8(self) -> bool:
        """FP8 training: the transformer layers' GEMMs in FP8, the rest BF16 (cluster.FP8)."""
        return self.precision == FP8

    @property
    def dtype_bytes(self) -> int:
        """Bytes of an activation, a gathered weight or a communicated element: FP8 training keeps
        them BF16."""
        precision = self.precision or self.cluster.dtype
        return DTYPE_BYTES["bf16" if precision == FP8 else precision]

    @property
    def state_dtype_bytes(self) -> int:
        """Bytes of a weight and of its gradient as the stack keeps them between steps (what ZeRO
        shards, DP gathers and Adam updates): FP32 under autocast over FP32 weights, else the
        training precision's."""
        return 4 if self.work.autocast else self.dtype_bytes

    @cached_property
    def work(self) -> Work:
        par = self.par
        stack = load_stack(self.stack)
        autocast = self.dtype_bytes == 2 and autocasts(
            stack.autocast, par.layout.cp * par.layout.dp
        )
        fused = self.compiled or self.switch("fused_kernels")
        tp_overlap = self.switch("tp_overlap") and par.sequence_parallel and par.layout.tp > 1
        return Work(
            self.model,
            self.cluster,
            par.layout,
            self.seq,
            self.micro_seqs,
            par.recompute,
            par.sequence_parallel,
            self.dtype_bytes,
            fused,
            self.attention,
            autocast,
            par.zero >= 1 and par.shard_ranks > 1,
            tp_overlap,
            self.switch("shared_kv"),
            self.attention_kernel,
            stack.pipeline_split,
            self.fp8,
            stack.rank_order,
            stack.selective,
        )

    @property
    def stage_layers(self) -> list[int]:
        """Transformer layers of each of the pp·V pipeline stages, as the stack splits them."""
        par = self.par
        return stage_layers(self.model, par.layout.pp, par.virtual_stages, self.work.pipeline_split)

    def __hash__(self) -> int:
        return _hash(self)


def autocasts(mode: str, replicas: int) -> bool:
    """Whether BF16 training computes by autocast over FP32 weights, under the stack's `autocast`
    mode (fourd.plan.stack.AUTOCAST), over `replicas` = CP × DP ranks: fourd does unless a
    data-parallel wrapper (FSDP2's mixed precision) computes with BF16 copies of the weights."""
    return mode == "always" or (mode == "unwrapped" and replicas == 1)


def _hash(obj) -> int:
    if "_hash" not in obj.__dict__:
        obj.__dict__["_hash"] = hash(tuple(getattr(obj, name) for name in obj.__dataclass_fields__))
    return obj.__dict__["_hash"]


def stage_layers(
    model: ModelConfig, pp: int, virtual_stages: int = 1, split: str = "layers"
) -> list[int]:
    """Transformer layers of each of the pp·V pipeline stages: by layers, the trainer's split
    (fourd.layout.layer_split), or the first and last stage only the embedding and the output when
    layers + 2 = pp·V (405B: 128 of one); by cost, nanotron's (`cost_split`) where it leaves the
    output layer on the last rank, without virtual stages."""
    if split == "cost" and virtual_stages == 1 and pp > 1:
        counts = cost_split(model, pp)
        if counts is not None:
            return counts
    return layer_split(model.layers, pp * virtual_stages, empty_edges=True)


def block_costs(model: ModelConfig) -> tuple[int, int]:
    """(a layer's, the output layer's) cost as nanotron weighs them to split a pipeline
    (`get_block_compute_costs`, src/nanotron/models/llama.py): 4·heads·head_dim·dim + 3·ffn·dim, and
    vocab·dim."""
    layer = 4 * model.heads * model.head_dim * model.dim + 3 * model.ffn * model.dim
    output_layer = model.vocab * model.dim
    return layer, output_layer


def cost_split(model: ModelConfig, pp: int) -> list[int] | None:
    """nanotron's split of a model over pp pipeline ranks (`build_model`, src/nanotron/models/base.py,
    with `block_costs`): its blocks in order, the embedding (cost 0), each layer, the final norm (0),
    the output layer, the cast and the loss (0); each block goes to the current rank, which
    hands over to the next once the running cost passes its share (r + 1)/pp of the total. The layers
    of each rank; None where the output layer lands before the last rank (its cast and loss after it:
    a split the planner's stages, the output layer on the last, do not describe)."""
    layer_cost, head_cost = block_costs(model)
    total = model.layers * layer_cost + head_cost
    thresholds = [total * (rank + 1) / pp for rank in range(pp)]
    counts = [0] * pp
    rank = 0
    cumulative = 0
    for _ in range(model.layers):
        counts[rank] += 1
        cumulative += layer_cost
        if cumulative > thresholds[rank]:
            rank += 1
    if rank != pp - 1:  # the output layer (cumulative then the total) goes to `rank`
        return None
    return counts
