"""Activation recomputation per transformer block, applied from outside like the parallelisms: "selective" keeps
what fourd.plan.memory.activation_bytes_per_token counts (no matmul, attention or reduction is recomputed), "full"
keeps only each block's input (docs/parallelism.md)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten, _c10d = torch.ops.aten, torch.ops._c10d_functional
KEEP = {
    _aten.mm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _c10d.all_reduce.default,
    _c10d.reduce_scatter_tensor.default,
}


def _selective(matmuls: int):
    """Fresh contexts for one block call. Its last matmul (w2) is left out: its output only joins the residual
    stream, backward never needs it, and recomputation stops before reaching it."""
    seen = {False: 0, True: 0}  # matmuls so far in the forward and in the recomputation

    def policy(ctx, op, *args, **kwargs):
        if op is _aten.mm.default:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] == matmuls:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_recompute(stage: nn.Module, mode: str) -> nn.Module:
    """Wrap each block's forward in place (parameter names unchanged): mode is one of fourd.layout.RECOMPUTE."""
    for block in stage.layers.values() if mode != "none" else ():
        kw = {}
        if mode == "selective":
            kw["context_fn"] = partial(_selective, sum(isinstance(m, nn.Linear) for m in block.modules()))
        block.forward = partial(checkpoint, block.forward, use_reentrant=False, **kw)
    return stage
