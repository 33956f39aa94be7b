"""Activation recomputation per transformer block, applied from outside (docs/parallelism.md):
"selective" recomputes no matmul, attention or reduction, "per-op" (torchtitan's) every other
matmul, "full" the whole block."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

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


def _contexts(matmuls: int, mode: str):
    """Fresh contexts for one block call. Selective does not keep the last matmul's (w2) output,
    which backward never needs; per-op keeps the 1st, 3rd, ... matmul's."""
    seen = {False: 0, True: 0}  # matmuls so far in the forward and in the recomputation

    def policy(ctx, op, *args, **kwargs):
        keep = op in KEEP
        if op is _aten.mm.default:
            seen[ctx.is_recompute] += 1
            count = seen[ctx.is_recompute]
            if mode == "per-op":
                keep = count % 2 == 1  # the 1st, 3rd, ... matmul
            else:
                keep = count < matmuls  # all but the last
        if keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_recompute(stage: nn.Module, mode: str) -> nn.Module:
    """Wrap each block's forward in place (parameter names unchanged): mode is one of
    fourd.layout.RECOMPUTE."""
    if mode == "none":
        return stage
    for block in stage.layers.values():
        options = {}
        if mode != "full":
            matmuls = len([module for module in block.modules() if isinstance(module, nn.Linear)])
            options["context_fn"] = partial(_contexts, matmuls, mode)
        block.forward = partial(checkpoint, block.forward, use_reentrant=False, **options)
    return stage
