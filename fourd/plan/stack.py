"""Software-stack profiles (TOML, docs/planner.md "Stacks"): what a training stack does that changes
a step's time, as physical switches, never a fitted efficiency of its own. Presets in
fourd/plan/stacks/, user profiles in $FOURD_HOME/stacks/ (they win), or a path."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import tomllib

from fourd.config import fourd_home
from fourd.errors import FourdError, did_you_mean
from fourd.layout import ZERO_STAGES, Layout
from fourd.plan.cluster import RANK_ORDERS
from fourd.schedules import SCHEDULES

PRESET_DIR = Path(__file__).parent / "stacks"
DEFAULT_STACK = "fourd"
# pipeline sends beside compute (torchtitan, fourd), each microbatch's exchanges waited for
# (Megatron's batch_isend_irecv and device synchronize), DeepSpeed's pipeline engine (blocking
# sends, a gradient-accumulation pass, gradients reduced after the last backward), or Megatron-LM's
# training loop since 2023-10-12: synchronous under 1F1B, overlapped under the interleaved schedule
PIPELINE_COMM = ("overlapped", "synchronous", "blocking", "interleaved-overlapped")
# the ZeRO stages that keep whole weights between steps, gathered once per step after the update
GATHERED_STAGES = (1, 2)
# the fused attention kernel families: FlashAttention-2 (flash-attn 2, torch SDPA's flash backend),
# cuDNN's fused attention (Transformer Engine's FusedAttention), the first FlashAttention (flash-attn 1.x)
# and FlashAttention in Triton (llm-foundry's attn_impl triton); their rates: fourd.plan.kernels
FUSED_ATTENTION = ("flash2", "cudnn", "flash1", "triton")
# when BF16 training computes by torch's autocast over FP32 weights: never (the stack holds BF16 weights
# and an FP32 copy in its optimizer: Megatron's Float16Module, DeepSpeed's BF16 engine, nanotron,
# Paddle's O2), where no data-parallel wrapper casts them (fourd: FSDP2's mixed precision casts once per
# gather), or always (PyTorch Lightning's and Hugging Face's `precision 16`/`bf16` over DDP)
AUTOCAST = ("never", "unwrapped", "always")
# the model-parallel dimensions a stack can split a model over (data parallelism it always runs)
MODEL_PARALLEL = ("tp", "cp", "pp")
# how a stack splits the layers over pipeline ranks: by layers (fourd's and Llama 3's split, the
# first and last stage one layer fewer; an even one where that divides) or by cost (nanotron:
# blocks in order until each rank holds its share of the layers' and the output layer's cost)
PIPELINE_SPLITS = ("layers", "cost")
# the precision data parallelism reduces gradients in, and its bytes per gradient: FP32 (Megatron-LM,
# whose --bf16 turns on accumulate_allreduce_grads_in_fp32, megatron/training/arguments.py; FSDP's
# reduce_dtype float32; fourd) or BF16 (NeMo's performance recipes, grad_reduce_in_fp32 = False)
GRAD_REDUCE_BYTES = {"fp32": 4, "bf16": 2}
# how ZeRO 1-3 reduce the gradients to their shards: one reduce-scatter (the default), or the whole
# gradients all-reduced on every rank, each keeping its shard's (InternEvo's Hybrid ZeRO: reduce_tensor
# all-reduces every bucket over the data-parallel group)
SHARD_REDUCES = ("reduce_scatter", "all_reduce")
# how ZeRO 1 and 2 gather the updated weights: one all-gather (the default), or each rank's shard
# broadcast on its own, one call per rank (InternEvo's broadcast_params)
WEIGHT_GATHERS = ("all_gather", "broadcast")
# what `--recompute selective` recomputes beside a fused (flash) attention kernel: the elementwise ops
# around the GEMMs, attention's output kept (fourd's policy, fourd.parallel.recompute), or the core
# attention, the fused kernel run again in the backward from the Q, K and V it keeps (Megatron-Core's
# recompute_granularity "selective", whose recompute_modules default to core_attn; Korthikanti et al.
# 2022 §5 with materialized attention)
SELECTIVE_POLICIES = ("elementwise", "attention")


@dataclass(frozen=True, kw_only=True)
class Stack:
    """A stack's switches. `fused_kernels`: the elementwise ops (norms, RoPE, activations, bias and
    residual adds) run fused into few kernels, as torch.compile fuses them (Transformer Engine,
    Megatron's fused kernels, XLA), so the block's memory traffic is the fused count;
    `tp_overlap`: with sequence parallelism, each TP all-gather and reduce-scatter runs in chunks
    beside the GEMM it feeds or follows (Transformer Engine's userbuffers, torch's async TP);
    `dp_overlap`: data-parallel gradient reductions and parameter gathers run beside the backward
    and forward (FSDP's prefetch, Megatron's --overlap-grad-reduce and --overlap-param-gather, XLA's
    scheduler); without it they follow the last backward, all exposed; `pipeline_comm`: the default
    of `--pipeline-comm`; `shared_kv`: with grouped-query attention, the attention kernel reads each
    K and V head for all of its query heads (SDPA's enable_gqa); without it they are copied to every
    query head first (torchtitan's repeat_kv), and the copies are kept for backward;
    `gather_in_step`: the ZeRO stages (of 1 and 2) whose weight all-gather runs inside the
    optimizer's step, after the update, exposed (nanotron's ZeroDistributedOptimizer, DeepSpeed's
    stage 1 and 2, fourd's ShardedAdamW); the others gather beside the next step's forward, layer
    by layer (FSDP's prefetch, Megatron's --overlap-param-gather); `fused_attention`: the fused
    attention kernel family the stack runs, "flash2" (FlashAttention-2) or "cudnn" (cuDNN's fused
    attention, where the GPU profile has its figures; Transformer Engine prefers it on Hopper);
    `autocast`: when BF16 training computes by autocast over FP32 weights, one of AUTOCAST above:
    every matrix is then cast to BF16 at each use, its gradient cast back to FP32 and added into the
    FP32 gradient, and the residual stream stays FP32 (docs/planner.md, "Stacks"); `dp_bucket_mb`:
    the MiB of gradients (in their parameters' dtype) per data-parallel reduction, each bucket its
    own collective call as the backward fills it (torch DDP's `bucket_cap_mb`, 25 by default); 0:
    one reduction per layer (FSDP's units, the layer-sized buckets of the other stacks);
    `pipeline_split`: how the layers are split over pipeline ranks, one of PIPELINE_SPLITS;
    `grad_accumulate_pass`: each microbatch's BF16 weight gradients are added into FP32 copies by a
    memory-bound pass of their own after the backward that made them (nanotron's FP32 gradient
    accumulator), not inside the weight-gradient GEMM (Megatron's gradient_accumulation_fusion) or
    not at all (gradients kept in one precision); DeepSpeed's pipeline engine makes the same pass,
    and `pipeline_comm = "blocking"` stands for that engine whole; `sharding_copies`: the stack
    shards weights parameter by parameter (FSDP2's fully_shard), so each all-gather's flat output
    is copied into the layer's parameters and each reduction's gradients copied, cast to FP32, into
    one flat input, both on the compute stream; FSDP1's flat parameters are views of the gathered
    buffer and cast their gradients beside compute (fourd.plan.perf.sharding_copies); `rank_order`:
    how the stack numbers its ranks, innermost dimension first, one of fourd.plan.cluster.RANK_ORDERS:
    which groups share a server, a rack or a pod (fourd's and Llama 3's data parallelism outermost,
    or Megatron's, DeepSpeed's, torchtitan's and nanotron's pipeline outermost); `grad_reduce`: the
    precision its data-parallel collectives reduce gradients in, a key of GRAD_REDUCE_BYTES: "bf16"
    moves half the bytes of "fp32" in every gradient reduce-scatter and all-reduce, and in a tied
    embedding's sync; `main_grads`: the weight gradients live in one contiguous buffer in that
    precision, the weight-gradient GEMM accumulating into it (Megatron's `main_grad` and
    `gradient_accumulation_fusion`), so a rank holds them in `grad_reduce`'s bytes, not in the
    weights' (Megatron-LM's docs/source/distrib_optimizer.md: BF16 weights with FP32 gradients, 18
    B a parameter, 6 + 12/d with the distributed optimizer); `shard_reduce`: how ZeRO 1 to 3 reduce
    the gradients to their shards, one of SHARD_REDUCES; `weight_gather`: how ZeRO 1 and 2 gather the
    updated weights, one of WEIGHT_GATHERS; `selective`: what its selective recomputation redoes beside
    a fused attention kernel, one of SELECTIVE_POLICIES.

    What the stack can run, which a search over open settings keeps to: `schedules`, the pipeline
    schedules it implements; `zero`, its ZeRO stages (sharding of optimizer state, gradients and
    weights); `pipeline_zero`, those it allows with pipeline parallelism (DeepSpeed's pipeline engine:
    0 and 1 only); `model_parallel`, the dimensions of MODEL_PARALLEL it splits a model over (none
    for DDP: every GPU holds the whole model)."""

    name: str
    description: str = ""
    fused_kernels: bool = False
    tp_overlap: bool = False
    dp_overlap: bool = True
    pipeline_comm: str = "overlapped"
    shared_kv: bool = False
    gather_in_step: tuple[int, ...] = ()
    fused_attention: str = "flash2"
    autocast: str = "unwrapped"
    dp_bucket_mb: float = 0.0
    pipeline_split: str = "layers"
    rank_order: str = RANK_ORDERS[0]
    grad_reduce: str = "fp32"
    grad_accumulate_pass: bool = False
    sharding_copies: bool = False
    main_grads: bool = False
    shard_reduce: str = SHARD_REDUCES[0]
    weight_gather: str = WEIGHT_GATHERS[0]
    selective: str = SELECTIVE_POLICIES[0]
    schedules: tuple[str, ...] = SCHEDULES
    zero: tuple[int, ...] = ZERO_STAGES
    pipeline_zero: tuple[int, ...] = ZERO_STAGES
    model_parallel: tuple[str, ...] = MODEL_PARALLEL

    def runs_layout(self, layout: Layout) -> bool:
        """Whether the stack splits the model as `layout` does (every dimension it uses is one
        of the stack's model-parallel dimensions, or data parallelism)."""
        return not self._beyond(layout)

    def _beyond(self, layout: Layout) -> list[str]:
        """`layout`'s model-parallel dimensions the stack does not run, as "tp=2"."""
        return [
            f"{dim}={getattr(layout, dim)}"
            for dim in MODEL_PARALLEL
            if getattr(layout, dim) > 1 and dim not in self.model_parallel
        ]

    def zero_stages(self, pp: int) -> tuple[int, ...]:
        """The ZeRO stages the stack runs on a layout with `pp` pipeline stages."""
        if pp > 1:
            return tuple(stage for stage in self.zero if stage in self.pipeline_zero)
        return self.zero

    def lacks(
        self,
        pp: int,
        schedule: str | None = None,
        zero: int | None = None,
        layout: Layout | None = None,
    ) -> str:
        """What of `schedule`, ZeRO stage `zero` on `pp` pipeline stages and `layout` the stack does
        not run, as a phrase; "" when it runs them all (None: not asked; without a pipeline every
        schedule is the same)."""
        missing = []
        beyond = self._beyond(layout) if layout is not None else []
        if beyond:
            runs = ", ".join(self.model_parallel) or "data parallelism only"
            missing.append(f"runs {runs}, not {', '.join(beyond)}")
        if schedule is not None and pp > 1 and schedule not in self.schedules:
            missing.append(f"runs the schedules {', '.join(self.schedules)}, not {schedule}")
        stages = self.zero_stages(pp)
        if zero is not None and zero not in stages:
            where = " with pipeline parallelism" if pp > 1 else ""
            missing.append(f"runs ZeRO {', '.join(map(str, stages))}{where}, not ZeRO {zero}")
        return " and ".join(missing)


def switch(stack: Stack, name: str, pinned: bool | None) -> bool:
    """The stack switch `name` (fused_kernels, tp_overlap, dp_overlap, shared_kv) of one plan: as
    pinned, else
    the stack's."""
    return getattr(stack, name) if pinned is None else pinned


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.toml"))


def _find(name_or_path: str) -> Path:
    """The profile's file: a path, a user profile, or a preset; FourdError naming the choices."""
    as_path = Path(name_or_path)
    if as_path.suffix == ".toml" or "/" in name_or_path:
        if not as_path.is_file():
            raise FourdError(f"stack profile {name_or_path} not found: give an existing .toml file")
        return as_path
    for folder in (fourd_home() / "stacks", PRESET_DIR):
        candidate = folder / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    names = preset_names()
    hint = _describing(name_or_path) or did_you_mean(name_or_path, names)
    raise FourdError(
        f"unknown stack {name_or_path!r}{hint}: presets "
        f"{', '.join(names)}, a file in $FOURD_HOME/stacks/, or a path to a .toml profile"
    )


def _describing(framework: str) -> str:
    """' (for torchtitan use --stack fsdp2)' when a preset's description names `framework` (a code
    base a preset stands for, such as torchtitan or MaxText), else ''."""
    wanted = framework.lower()
    for name in preset_names():
        description = load_stack(str(PRESET_DIR / f"{name}.toml")).description
        if wanted in re.findall(r"[\w.-]+", description.lower()):
            return f" (for {framework} use --stack {name})"
    return ""


@lru_cache(maxsize=64)
def load_stack(name_or_path: str = DEFAULT_STACK) -> Stack:
    """The stack called `name_or_path` (user profiles first, then presets) or the one at that
    path."""
    path = _find(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise FourdError(f"{path}: not a readable TOML stack profile ({e}); fix it") from None
    fields = {"name": str, "description": str, "fused_kernels": bool, "tp_overlap": bool}
    fields |= {"dp_overlap": bool, "pipeline_comm": str, "shared_kv": bool, "fused_attention": str}
    fields |= {"autocast": str, "schedules": list, "zero": list, "pipeline_zero": list}
    fields |= {"gather_in_step": list, "model_parallel": list, "dp_bucket_mb": object}
    fields |= {"pipeline_split": str, "grad_accumulate_pass": bool, "sharding_copies": bool}
    fields |= {"rank_order": str, "grad_reduce": str, "main_grads": bool}
    fields |= {"shard_reduce": str, "weight_gather": str, "selective": str}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise FourdError(
            f"{path}: unknown stack key(s) {', '.join(unknown)}; known: {', '.join(fields)}"
        )
    for key, kind in fields.items():
        if key in data and not isinstance(data[key], kind):
            raise FourdError(f"{path}: {key} must be a {kind.__name__}, not {data[key]!r}")
    bucket = data.get("dp_bucket_mb", 0.0)
    if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not 0 <= bucket < 1e9:
        raise FourdError(
            f"{path}: dp_bucket_mb = {bucket!r}; give the MiB of a gradient bucket (0: one per layer)"
        )
    for key, words in (
        ("pipeline_comm", PIPELINE_COMM),
        ("fused_attention", FUSED_ATTENTION),
        ("autocast", AUTOCAST),
        ("pipeline_split", PIPELINE_SPLITS),
        ("rank_order", RANK_ORDERS),
        ("grad_reduce", tuple(GRAD_REDUCE_BYTES)),
        ("shard_reduce", SHARD_REDUCES),
        ("weight_gather", WEIGHT_GATHERS),
        ("selective", SELECTIVE_POLICIES),
    ):
        if key in data and data[key] not in words:
            raise FourdError(f"{path}: {key} = {data[key]!r}; allowed: {', '.join(words)}")
    for key, allowed in (("schedules", SCHEDULES), ("zero", ZERO_STAGES)):
        _check_choices(path, key, data.get(key, list(allowed)), allowed)
    _check_choices(path, "pipeline_zero", data.get("pipeline_zero", list(ZERO_STAGES)), ZERO_STAGES)
    if data.get("gather_in_step"):  # may be empty: every gather beside the forward
        _check_choices(path, "gather_in_step", data["gather_in_step"], GATHERED_STAGES)
    if data.get("model_parallel"):  # may be empty: data parallelism only
        _check_choices(path, "model_parallel", data["model_parallel"], MODEL_PARALLEL)
    lists = {
        key: tuple(data[key])
        for key in ("schedules", "zero", "pipeline_zero", "gather_in_step", "model_parallel")
        if key in data
    }
    return Stack(**{"name": path.stem} | data | lists)


def _check_choices(path: Path, key: str, values: list, allowed: tuple) -> None:
    """A list key of a stack profile: a non-empty list of known choices, each once."""
    unknown = [value for value in values if value not in allowed or isinstance(value, bool)]
    if not values or unknown or len(set(values)) != len(values):
        raise FourdError(
            f"{path}: {key} = {values!r}; give a non-empty list of distinct values from "
            f"{', '.join(map(str, allowed))}"
        )


def parse_stack(text: str) -> str:
    """A `--stack` value: a name or path that loads (the planner carries it as given)."""
    load_stack(str(text))
    return str(text)
