"""Context parallelism, Llama 3 style: rank i of CP holds chunks i and 2·CP−1−i of each sequence cut
in 2·CP, and attention all-gathers K and V (the KV heads, not heads repeated for GQA) over the cp
group (docs/pipeline-context.md).
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
            f"sequence length {seq_len} must be a multiple of 2·cp = {2 * cp}: "
            "choose it accordingly"
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
    """All-gather along a new leading dimension; backward reduce-scatters the gradient (all queries
    use all K, V)."""

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
        rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
        self.cp = cp_size
        self.register_buffer("q_pos", cp_positions(seq_len, rank, cp_size), persistent=False)
        # Keys arrive in rank order, each rank's two chunks together: their true positions in that
        # order.
        self.register_buffer(
            "k_pos",
            torch.cat([cp_positions(seq_len, peer, cp_size) for peer in range(cp_size)]),
            persistent=False,
        )
        self.gathered_elements = 0

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # query: [b, s/cp, hq, d]; key, value: [b, s/cp, hkv, d] with local heads only under TP.
        # keys_values: [cp, 2, b, s/cp, hkv, d]
        keys_values = _GatherKV.apply(torch.stack((key, value)), self.group)
        self.gathered_elements += keys_values.numel() // self.cp * (self.cp - 1)
        # k_all, v_all: [b, s, hkv, d]
        k_all, v_all = (keys_values[:, i].transpose(0, 1).flatten(1, 2) for i in (0, 1))
        query, k_all, v_all = (tensor.transpose(1, 2) for tensor in (query, k_all, v_all))
        # CUDA's kernels that take a mask do not take shared KV heads: they would fall back to math
        if query.device.type in REPEAT_KV_ON:
            repeats = query.shape[1] // k_all.shape[1]
            k_all = k_all.repeat_interleave(repeats, dim=1)
            v_all = v_all.repeat_interleave(repeats, dim=1)
        mask = self.q_pos[:, None] >= self.k_pos[None, :]
        return F.scaled_dot_product_attention(
            query, k_all, v_all, attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)


def apply_cp(stage: nn.Module, cp_mesh, seq_len: int) -> nn.Module:
    """Make `stage` (after TP) run on this rank's 2 chunks of each sequence of exactly `seq_len`
    tokens (inputs cut by `cp_shard`): ContextParallelAttention cores, and the rope rows of the
    rank's tokens."""
    group = cp_mesh  # a process group, or a mesh of one
    if hasattr(cp_mesh, "get_group"):
        group = cp_mesh.get_group()
    rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    if cp_size == 1:
        return stage
    cfg = stage.cfg
    if seq_len > cfg.max_seq:
        raise FourdError(
            f"sequence length {seq_len} exceeds the model's max_seq {cfg.max_seq}: shorten it"
        )
    positions = cp_positions(seq_len, rank, cp_size)
    device = stage.rope.cos.device
    cos, sin = rope_table(cfg.head_dim, positions, cfg.rope_theta)
    stage.rope.register_buffer("cos", cos.to(device), persistent=False)
    stage.rope.register_buffer("sin", sin.to(device), persistent=False)
    for layer in stage.layers.values():
        layer.attention.core = ContextParallelAttention(group, seq_len).to(device)
    return stage
