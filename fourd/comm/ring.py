"""Ring all-reduce on point-to-point send/recv, with its own accounting (docs/comm.md): N−1
reduce-scatter and N−1 all-gather steps over N chunks, each rank sending 2(N−1)/N of the tensor, the
lower bound for all-reduce (Patarasuk & Yuan 2009, Theorem 1); chunks travel in segments so that
receiving and forwarding overlap."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

SEGMENT_BYTES = 4 << 20  # best of 256 KiB, 1 MiB, 4 MiB and whole chunks here (docs/comm.md)

_COMBINE = {
    dist.ReduceOp.SUM: torch.Tensor.add_,
    dist.ReduceOp.PRODUCT: torch.Tensor.mul_,
    dist.ReduceOp.MAX: lambda into, other: torch.maximum(into, other, out=into),
    dist.ReduceOp.MIN: lambda into, other: torch.minimum(into, other, out=into),
}


@dataclass
class RingStats:
    """What one rank did in one ring all-reduce."""

    world: int
    steps: int = 0  # ring steps: N−1 reduce-scatter + N−1 all-gather
    bytes_sent: int = 0  # payload this rank sent, padding included
    pad_elems: int = 0  # zeros appended so that N divides the length
    messages: int = 0  # point-to-point sends (steps × segments)


def _schedule(rank: int, ranks: int) -> tuple[list[bool], list[int], list[int]]:
    """Per ring step: whether it reduces, the chunk received, the chunk sent (what arrives at step t
    leaves at t+1)."""
    reducing, recv_of, send_of = [], [], []
    for step in range(ranks - 1):  # reduce-scatter: chunk rank - step moves on, summed
        reducing.append(True)
        recv_of.append((rank - step - 1) % ranks)
        send_of.append((rank - step) % ranks)
    for step in range(ranks - 1):  # all-gather: the reduced chunk rank + 1 goes round
        reducing.append(False)
        recv_of.append((rank - step) % ranks)
        send_of.append((rank + 1 - step) % ranks)
    return reducing, recv_of, send_of


def _flat_padded(tensor: torch.Tensor, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor as one flat view (a copy if it is not contiguous), and that view padded with
    zeros to a multiple of `ranks` elements (the view itself when no padding is needed)."""
    if tensor.is_contiguous():
        flat = tensor.view(-1)
    else:
        flat = tensor.reshape(-1).clone()
    chunk = -(-flat.numel() // ranks)
    pad = chunk * ranks - flat.numel()
    if pad == 0:
        return flat, flat
    return flat, torch.cat([flat, flat.new_zeros(pad)])


def ring_all_reduce(
    tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, segment_bytes=SEGMENT_BYTES
) -> RingStats:
    """Reduce `tensor` in place across `group` (default: the world), like `dist.all_reduce`."""
    if op not in _COMBINE:
        raise ValueError(f"ring_all_reduce supports SUM, PRODUCT, MAX and MIN, not {op}")
    ranks = dist.get_world_size(group)
    stats = RingStats(world=ranks)
    if ranks == 1 or tensor.numel() == 0:
        return stats
    rank = dist.get_rank(group)
    next_rank, prev_rank = (rank + 1) % ranks, (rank - 1) % ranks  # the ring's neighbours

    flat, buf = _flat_padded(tensor, ranks)
    stats.pad_elems = buf.numel() - flat.numel()
    chunk = buf.numel() // ranks
    chunks = buf.view(ranks, chunk)
    bounds = _segment_bounds(chunk, buf.element_size(), segment_bytes)
    n_seg = len(bounds) - 1
    incoming = torch.empty(chunk, dtype=buf.dtype, device=buf.device)
    combine = _COMBINE[op]

    steps = 2 * (ranks - 1)  # N−1 reduce-scatter steps, then N−1 all-gather steps
    reducing, recv_of, send_of = _schedule(rank, ranks)

    def post(step: int, j: int):
        start, stop = bounds[j], bounds[j + 1]
        seg = chunks[send_of[step], start:stop]
        if reducing[step]:
            target = incoming[start:stop]  # summed into its chunk when it arrives
        else:
            target = chunks[recv_of[step], start:stop]
        # one tag per message: segments in flight at once never match the wrong receive
        tag = step * n_seg + j
        stats.bytes_sent += seg.numel() * seg.element_size()
        stats.messages += 1
        return (
            dist.isend(seg, group=group, group_dst=next_rank, tag=tag),
            dist.irecv(target, group=group, group_src=prev_rank, tag=tag),
        )

    # A segment received in place at step t + 1 may still be in this rank's send of step t only when
    # N = 2, and then the peer has received that send in full before it sends the segment back.
    pending = [post(0, j) for j in range(n_seg)]
    for step in range(steps):
        following = []
        for j, (_, recv) in enumerate(pending):
            recv.wait()
            if reducing[step]:
                start, stop = bounds[j], bounds[j + 1]
                combine(chunks[recv_of[step], start:stop], incoming[start:stop])
            if step + 1 < steps:
                following.append(post(step + 1, j))
        for send, _ in pending:
            send.wait()
        pending = following
        stats.steps += 1

    _copy_back(tensor, flat, buf)
    return stats


def _segment_bounds(chunk: int, element_size: int, segment_bytes: int) -> list[int]:
    """Element offsets that cut a chunk of `chunk` elements into ceil(chunk bytes / segment_bytes)
    near-equal segments (at least one, and none smaller than one element)."""
    segments = max(1, min(chunk, -(-chunk * element_size // segment_bytes)))
    return [chunk * j // segments for j in range(segments + 1)]


def _copy_back(tensor: torch.Tensor, flat: torch.Tensor, buf: torch.Tensor) -> None:
    """The reduced values into `tensor`: from the padded buffer, without its padding, when the
    ring ran on a copy."""
    if buf is not flat:
        flat.copy_(buf[: flat.numel()])
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
