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
    dist.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
    dist.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
}


@dataclass
class RingStats:
    """What one rank did in one ring all-reduce."""

    world: int
    steps: int = 0  # ring steps: N−1 reduce-scatter + N−1 all-gather
    bytes_sent: int = 0  # payload this rank sent, padding included
    pad_elems: int = 0  # zeros appended so that N divides the length
    messages: int = 0  # point-to-point sends (steps × segments)


def _schedule(rank: int, n: int) -> tuple[list[bool], list[int], list[int]]:
    """Per ring step: whether it reduces, the chunk received, the chunk sent (what arrives at step t
    leaves at t+1)."""
    reducing = [t < n - 1 for t in range(2 * (n - 1))]
    recv_of = [
        (rank - t - 1) % n if r else (rank - (t - n + 1)) % n for t, r in enumerate(reducing)
    ]
    send_of = [
        (rank - t) % n if r else (rank + 1 - (t - n + 1)) % n for t, r in enumerate(reducing)
    ]
    return reducing, recv_of, send_of


def ring_all_reduce(
    tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, segment_bytes=SEGMENT_BYTES
) -> RingStats:
    """Reduce `tensor` in place across `group` (default: the world), like `dist.all_reduce`."""
    if op not in _COMBINE:
        raise ValueError(f"ring_all_reduce supports SUM, PRODUCT, MAX and MIN, not {op}")
    n = dist.get_world_size(group)
    stats = RingStats(world=n)
    if n == 1 or tensor.numel() == 0:
        return stats
    rank = dist.get_rank(group)
    nxt, prv = (rank + 1) % n, (rank - 1) % n

    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunk = -(-flat.numel() // n)
    stats.pad_elems = chunk * n - flat.numel()
    buf = flat if stats.pad_elems == 0 else torch.cat([flat, flat.new_zeros(stats.pad_elems)])
    chunks = buf.view(n, chunk)
    n_seg = max(1, min(chunk, -(-chunk * buf.element_size() // segment_bytes)))
    bounds = [chunk * j // n_seg for j in range(n_seg + 1)]
    incoming = torch.empty(chunk, dtype=buf.dtype, device=buf.device)
    combine = _COMBINE[op]

    steps, (reducing, recv_of, send_of) = 2 * (n - 1), _schedule(rank, n)

    def post(t: int, j: int):
        lo, hi = bounds[j], bounds[j + 1]
        seg = chunks[send_of[t], lo:hi]
        target = incoming[lo:hi] if reducing[t] else chunks[recv_of[t], lo:hi]
        tag = (
            t * n_seg + j
        )  # one tag per message: segments in flight at once never match the wrong receive
        stats.bytes_sent += seg.numel() * seg.element_size()
        stats.messages += 1
        return (
            dist.isend(seg, group=group, group_dst=nxt, tag=tag),
            dist.irecv(target, group=group, group_src=prv, tag=tag),
        )

    # A segment received in place at step t + 1 may still be in this rank's send of step t only when
    # N = 2, and then the peer has received that send in full before it sends the segment back.
    pending = [post(0, j) for j in range(n_seg)]
    for t in range(steps):
        following = []
        for j, (_, recv) in enumerate(pending):
            recv.wait()
            if reducing[t]:
                lo, hi = bounds[j], bounds[j + 1]
                combine(chunks[recv_of[t], lo:hi], incoming[lo:hi])
            if t + 1 < steps:
                following.append(post(t + 1, j))
        for send, _ in pending:
            send.wait()
        pending = following
        stats.steps += 1

    if buf is not flat:
        flat.copy_(buf[: flat.numel()])
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return stats
