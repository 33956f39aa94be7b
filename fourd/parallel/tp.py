"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), optionally with sequence parallelism
(Korthikanti et al. 2022), applied from outside to the unmodified Llama with DTensor; the plan is in
docs/parallelism.md."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard a Llama or a pipeline stage of it in place. With sequence parallelism a stage without
    tok_embeddings takes this rank's sequence shard [b, S/TP, dim], and one without output returns
    its shard."""
    if tp_mesh.size() == 1:
        return model
    parallelize_module(model, tp_mesh, _tp_plan(model, sequence_parallel))
    if model.tok_embeddings is not None and not sequence_parallel:
        # Its all-reduce returns an AsyncCollectiveTensor, which a compiled block cannot take as
        # input (the gradient it returns is a plain tensor): wait for it here, in a copy.
        model.tok_embeddings.register_forward_hook(lambda module, args, out: out.clone())
    if sequence_parallel:
        _sequence_parallel_edges(model, tp_mesh)
    return model


def _tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, object]:
    """Module name -> its sharding style (docs/parallelism.md): Megatron's column-then-row pairs."""
    if sequence_parallel:
        stream: Placement = Shard(1)
    else:
        stream = Replicate()
    plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=not sequence_parallel
        )
    for name in model.layers:
        block = f"layers.{name}"
        # One conversion per branch input, so that the gradients of q, k, v (or w1, w3) add up as
        # partial sums and cross the network in one all-reduce, not three.
        plan[f"{block}.attention"] = PrepareModuleInput(
            input_layouts=(stream, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=False,
        )
        plan[f"{block}.feed_forward"] = PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        for linear in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "feed_forward.w1",
            "feed_forward.w3",
        ):
            plan[f"{block}.{linear}"] = ColwiseParallel()
        for linear in ("attention.wo", "feed_forward.w2"):
            plan[f"{block}.{linear}"] = RowwiseParallel(
                output_layouts=stream, use_local_output=not sequence_parallel
            )
        if sequence_parallel:
            plan |= {
                f"{block}.{norm}": SequenceParallel() for norm in ("attention_norm", "ffn_norm")
            }
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
        )
    return plan


def _sequence_parallel_edges(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The norm-weight gradients summed over TP, and a pipeline stage's edges kept on the sequence
    shard."""
    stream = Shard(1)
    # Each rank's norm-weight gradient covers only its own tokens: a partial sum that autograd
    # leaves as such in .grad. Sum it here (Megatron does the same), so that the optimizer and the
    # gradient norm see the true gradient; FSDP, when applied on top, does this reduction itself.
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.register_post_accumulate_grad_hook(_sum_partial_grad)
    if model.tok_embeddings is None:
        stage_input = PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(stream,), use_local_output=False
        )
        parallelize_module(model, tp_mesh, stage_input)
    if model.output is None:
        stage_output = PrepareModuleOutput(
            output_layouts=(stream,), desired_output_layouts=(stream,), use_local_output=True
        )
        parallelize_module(model, tp_mesh, stage_output)


def _sum_partial_grad(param: torch.Tensor) -> None:
    if any(placement.is_partial() for placement in param.grad.placements):
        param.grad = param.grad.redistribute(placements=param.placements)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [b, s, vocab], plain or a DTensor sharded on the
    vocabulary (never gathered), against targets [b, s]; a plain scalar tensor."""
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    (tp_dim,) = [
        i
        for i, placement in enumerate(logits.placements)
        if placement.is_shard() and placement.dim in (-1, logits.ndim - 1)
    ]
    mesh = logits.device_mesh
    local = logits.to_local().flatten(0, 1).float()
    vocab_start = mesh.get_local_rank(tp_dim) * local.shape[-1]
    per_token = _VocabParallelCrossEntropy.apply(
        local, targets.flatten(), vocab_start, mesh.get_group(tp_dim)
    )
    return per_token.mean()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """-log softmax(z)[t] when each rank holds a block of the vocabulary columns of z: forward
    all-reduces [tokens] numbers only (row max; row sum of exp with the target logit); backward
    needs no communication."""

    @staticmethod
    def forward(
        ctx, local: torch.Tensor, targets: torch.Tensor, vocab_start: int, group
    ) -> torch.Tensor:
        row_max = local.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local - row_max[:, None]
        exp = shifted.exp()
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < local.shape[-1])
        local_t = torch.where(mine, local_t, torch.zeros_like(local_t))
        target_logit = shifted.gather(1, local_t[:, None]).squeeze(1) * mine
        sums = torch.stack((exp.sum(dim=-1), target_logit))
        dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums
        ctx.save_for_backward(exp / sum_exp[:, None], local_t, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_t, mine = ctx.saved_tensors
        grad_logits = softmax * grad[:, None]
        grad_logits.scatter_add_(1, local_t[:, None], -(grad * mine)[:, None])
        return grad_logits, None, None, None
