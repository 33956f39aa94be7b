"""Data parallelism over the dp×cp ranks (ZeRO, Rajbhandari et al. 2020; FSDP2 in PyTorch).

Every mode is applied per transformer block, then to the whole stage, so that each block's parameters
are gathered (and its gradients reduced) as one bucket that overlaps with the neighbouring blocks'
compute. Gradients are averaged over the mesh: with each rank's loss a mean over its own tokens (equal
counts everywhere) the average is the gradient of the global-batch mean.

- ddp: every rank keeps full parameters, gradients and optimizer state; gradients are all-reduced.
  Built on FSDP2's replicate (torch.distributed._composable.replicate_with_fsdp), because the classic
  DistributedDataParallel cannot hold the DTensor parameters that tensor parallelism makes.
- zero3: parameters, gradients and optimizer state sharded; parameters re-gathered in backward
  (reshard after forward).
- zero2: the same shards, but parameters stay gathered from forward to backward: one all-gather per
  step instead of two, for more memory. Llama 3's choice (brief.md §3).
- hsdp: a 2-D mesh (dp_replicate, dp_shard·cp): ZeRO-3 shards inside each dp_shard group, replicas
  across groups, so only the gradient all-reduce crosses the slower links.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fourd.errors import FourdError

DP_MODES = ("ddp", "zero2", "zero3", "hsdp")


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, mode: str = "zero3") -> nn.Module:
    """Wrap a Llama or a pipeline stage of it in place; dp_mesh comes from fourd.parallel.mesh.dp_cp_mesh.

    On CUDA parameters are computed in BF16 and gradients reduced in FP32; on CPU everything is FP32.
    """
    if mode not in DP_MODES:
        raise FourdError(f"data-parallel mode {mode!r}: choose one of {', '.join(DP_MODES)}")
    if (mode == "hsdp") != (dp_mesh.ndim == 2):
        raise FourdError(
            f"data-parallel mode {mode} needs a {'2-D (dp_replicate, dp_shard)' if mode == 'hsdp' else '1-D'} mesh, "
            f"got {dp_mesh.ndim}-D: build the mesh with hsdp_replicate set exactly when the mode is hsdp"
        )
    if dp_mesh.size() == 1:
        return model
    if dp_mesh.device_type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    if mode == "ddp":
        wrap = partial(replicate, mesh=dp_mesh, mp_policy=mp)
    else:
        wrap = partial(fully_shard, mesh=dp_mesh, reshard_after_forward=mode != "zero2", mp_policy=mp)
    for block in model.layers.values():
        wrap(block)
    wrap(model)
    return model


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors' local shards (FSDP keeps padded storages),
    i.e. what this rank really holds for them."""
    storages = {}
    for t in tensors:
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())
