"""Context parallelism, Llama 3 style: rank i of CP holds chunks i and 2·CP−1−i of each sequence cut in 2·CP, and
attention all-gathers K and V (the KV heads, not heads repeated for GQA) over the cp group (docs/pipeline-context.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fourd.errors import FourdError
from fourd.model.llama import rope_table

# Device types whose attention kernels that take a mask do not take shared KV heads (CUDA's would fall back to
# math): there K and V are repeated to every query head first. A test adds "cpu" to run that path on a CPU.
REPEAT_KV_ON = {"cuda"}


def cp_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """True positions of the tokens rank `cp_rank` holds, in the order it holds them."""
    if seq_len % (2 * cp):
        raise FourdError(
            f"sequence length {seq_len} must be a multiple of 2·cp = {2 * cp}: choose it accordingly"
        )
    chunk = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat(
        (
            torch.arange(first * chunk, (first + 1) * chunk),
            torch.arange(second * chunk, (second + 1) * chunk),
        )
    )


def cp_shard(tensor: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `tensor` along the sequence dimension `dim`."""
    if cp == 1:
        return tensor
    index = cp_positions(tensor.shape[dim], cp_rank, cp).to(tensor.device)
    return tensor.index_select(dim, index)


class _GatherKV(torch.autograd.Function):
    """All-gather along a new leading dimension; backward reduce-scatters the gradient (all queries use all K, V)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.shape = local.shape
        out = local.new_empty(dist.get_world_size(group) * local.numel())
        dist.all_gather_single(out, local.reshape(-1), group=group)
        return out.view(-1, *local.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(ctx.shape.numel())
        dist.reduce_scatter_single(out, grad.reshape(-1), op=dist.ReduceOp.SUM, group=ctx.group)
        return out.view(ctx.shape), None


class ContextParallelAttention(nn.Module):
    """Drop-in for `CausalAttention`: local queries against the cp group's gathered keys and values;
    `gathered_elements` counts the K and V elements received from the other cp ranks."""

    def __init__(self, group: dist.ProcessGroup, seq_len: int):
        super().__init__()
        self.group = group
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        self.cp = cp
        self.register_buffer("q_pos", cp_positions(seq_len, rank, cp), persistent=False)
        # Keys arrive in rank order, each rank's two chunks together: their true positions in that order.
        self.register_buffer(
            "k_pos", torch.cat([cp_positions(seq_len, r, cp) for r in range(cp)]), persistent=False
        )
        self.gathered_elements = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [b, s/cp, hq, d]; k, v: [b, s/cp, hkv, d] with local heads only under TP.
        kv = _GatherKV.apply(torch.stack((k, v)), self.group)  # [cp, 2, b, s/cp, hkv, d]
        self.gathered_elements += kv.numel() // self.cp * (self.cp - 1)
        k_all, v_all = (kv[:, i].transpose(0, 1).flatten(1, 2) for i in (0, 1))  # [b, s, hkv, d]
        q, k_all, v_all = (t.transpose(1, 2) for t in (q, k_all, v_all))
        if q.device.type in REPEAT_KV_ON:
            k_all, v_all = (
                t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k_all, v_all)
            )
        mask = self.q_pos[:, None] >= self.k_pos[None, :]
        return F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)


def apply_cp(stage: nn.Module, cp_mesh, seq_len: int) -> nn.Module:
    """Make `stage` (after TP) run on this rank's 2 chunks of each sequence of exactly `seq_len` tokens (inputs cut
    by `cp_shard`): ContextParallelAttention cores, and the rope rows of the rank's tokens."""
    group = cp_mesh.get_group() if hasattr(cp_mesh, "get_group") else cp_mesh
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    if cp == 1:
        return stage
    cfg = stage.cfg
    if seq_len > cfg.max_seq:
        raise FourdError(
            f"sequence length {seq_len} exceeds the model's max_seq {cfg.max_seq}: shorten it"
        )
    positions = cp_positions(seq_len, rank, cp)
    device = stage.rope.cos.device
    cos, sin = rope_table(cfg.head_dim, positions, cfg.rope_theta)
    stage.rope.register_buffer("cos", cos.to(device), persistent=False)
    stage.rope.register_buffer("sin", sin.to(device), persistent=False)
    for layer in stage.layers.values():
        layer.attention.core = ContextParallelAttention(group, seq_len).to(device)
    return stage
