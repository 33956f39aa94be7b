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
    grads = [param.grad for param in params if param.grad is not None]
    device = "cpu"
    if grads:
        first = grads[0]
        if isinstance(first, DTensor):
            first = first.to_local()
        device = first.device
    total = torch.zeros((), device=device)
    for grad in grads:
        if not isinstance(grad, DTensor):
            total = total + grad.float().pow(2).sum()
            continue
        grad = _without_partials(grad)
        key = (grad.device_mesh, grad.placements)
        squares = grad.to_local().float().pow(2).sum()
        if key in groups:
            squares = groups[key] + squares
        groups[key] = squares
    for (dmesh, placements), squares in groups.items():
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():
                dist.all_reduce(squares, group=dmesh.get_group(dim))
        total = total + squares
    if mesh is not None and "pp" in mesh.mesh_dim_names and mesh["pp"].size() > 1:
        dist.all_reduce(total, group=mesh["pp"].get_group())
    return total.sqrt()


def _without_partials(grad: DTensor) -> DTensor:
    """The gradient with its partial sums (sequence-parallel norm weights) summed: replicated."""
    if not any(placement.is_partial() for placement in grad.placements):
        return grad
    placements = list(grad.placements)
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            placements[dim] = Replicate()
    return grad.redistribute(placements=placements)


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, mesh: DeviceMesh | None = None) -> float:
    """Scale all gradients in place by max_norm / (norm + 1e-6) when the global norm exceeds
    max_norm (as torch.nn.utils.clip_grad_norm_); returns the norm before clipping (the same float
    on every rank). max_norm <= 0 or inf only measures."""
    params = [param for param in params if param.grad is not None]
    norm = grad_norm(params, mesh).item()
    if 0 < max_norm < float("inf") and norm + 1e-6 > max_norm:
        scale = max_norm / (norm + 1e-6)
        for param in params:
            param.grad.mul_(scale)
    return norm
