"""The global gradient norm and clipping, over gradients sharded every way the layout shards
them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def grad_norm(params, mesh: DeviceMesh | None = None) -> torch.Tensor:
    """‖g‖₂ over every gradient of the model, identical on every rank (an FP32 scalar tensor): a
    DTensor's local squares summed over the mesh dimensions that shard it, once over those that
    replicate it; stages add over pp."""
    # Sums of squares of the local shards, one per (mesh, placements), in first-seen order: every
    # rank of a stage holds the same parameters in the same order, so they agree on the reductions
    # below.
    groups: dict[tuple, torch.Tensor] = {}
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    total = torch.zeros((), device=local[0].device if local else "cpu")
    for g in grads:
        if not isinstance(g, DTensor):
            total = total + g.float().pow(2).sum()
            continue
        if any(pl.is_partial() for pl in g.placements):
            g = g.redistribute(
                placements=[Replicate() if pl.is_partial() else pl for pl in g.placements]
            )
        key = (g.device_mesh, g.placements)
        sq = g.to_local().float().pow(2).sum()
        groups[key] = groups[key] + sq if key in groups else sq
    for (dmesh, placements), sq in groups.items():
        for dim, pl in enumerate(placements):
            if not pl.is_replicate():
                dist.all_reduce(sq, group=dmesh.get_group(dim))
        total = total + sq
    if mesh is not None and "pp" in mesh.mesh_dim_names and mesh["pp"].size() > 1:
        dist.all_reduce(total, group=mesh["pp"].get_group())
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, mesh: DeviceMesh | None = None) -> float:
    """Scale all gradients in place so that their global norm is at most max_norm; returns the norm
    before clipping (the same float on every rank). max_norm <= 0 or inf only measures."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params, mesh).item()
    if 0 < max_norm < float("inf") and norm + 1e-6 > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(scale)
    return norm
