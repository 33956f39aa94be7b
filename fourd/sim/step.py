"""Discrete-event simulation of one training step, driven by the `fourd.schedules` action lists.

Each pipeline rank runs its compute actions in the schedule's order. An action's duration comes
from the planner's cost model (`fourd.plan.perf.chunk_times`: GEMMs, attention, memory-bound
kernels, and the TP and CP collectives inside the stage, which run on the critical path). Between
actions the simulator moves bytes: activations and their gradients between pipeline stages, and
the data-parallel collectives (per-layer buckets: gradients reduced as soon as a layer's last
backward produces them, weights gathered before their first use, on one stream per kind as NCCL
runs them). Transfers are fluid flows that share links (`fourd.sim.network`): a GPU's NIC in each
direction, its NVLink port; a flow alone reaches what its placement allows (`group_bandwidth`:
NVLink, one NIC, or its share of the oversubscribed uplinks between pods).

Symmetry. All data-parallel replicas run the same schedule at the same speed, and all TP and CP
ranks of a pipeline stage do the same work, so one GPU per pipeline rank stands for all the others
and a 16,384-GPU step costs as much as a 16-GPU pipeline. What this assumes: identical GPUs and
links, every group's traffic in lock step with its copies (so each pod uplink is shared evenly by
the GPUs that cross it), and TP/CP collectives that do not compete with PP and DP traffic (they
run on NVLink inside a server, or as the planner prices them). A straggler (`slow`) breaks the
symmetry for one replica: the simulator then runs two classes of replica, the slow one and the
rest, which meet in every data-parallel collective.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fourd.errors import FourdError
from fourd.plan.cluster import Group, group_bandwidth, group_level, members_per_node, shard_group
from fourd.plan.memory import stage_layers, stage_params
from fourd.plan.perf import chunk_times, collective_time, optimizer_time, ring_bytes_per_rank
from fourd.schedules import Action, Schedule
from fourd.sim.network import Flow, Network
from fourd.sim.pipeline import Event


def stage_costs(
    model,
    cluster,
    layout,
    seq: int,
    micro_seqs: int,
    virtual_stages: int,
    recompute: str = "none",
    comm: bool = True,
    sequence_parallel: bool = True,
) -> list[dict[str, float]]:
    """Seconds of each action kind ("F", "B", "I", "W") per global stage, from the planner's cost model.

    TP and CP collectives are part of F, B and I (they sit on the critical path of every layer);
    `comm=False` leaves them out.
    """
    out = []
    for t in chunk_times(model, cluster, layout, seq, micro_seqs, virtual_stages, recompute, sequence_parallel):
        f = t.forward_s + (t.forward_comm_s if comm else 0.0)
        i = t.input_grad_s + (t.backward_comm_s if comm else 0.0)
        out.append({"F": f, "I": i, "W": t.weight_grad_s, "B": i + t.weight_grad_s})
    return out


def cost_duration(
    model,
    cluster,
    layout,
    seq: int,
    micro_seqs: int,
    virtual_stages: int = 1,
    recompute: str = "none",
    comm: bool = True,
    sequence_parallel: bool = True,
):
    """A duration function for `fourd.sim.pipeline.timeline`: the cost model's time of each Action."""
    costs = stage_costs(model, cluster, layout, seq, micro_seqs, virtual_stages, recompute, comm, sequence_parallel)
    return lambda a: costs[a.stage][a.kind]


@dataclass(frozen=True)
class Transfer:
    replica: int  # 0: the replicas that stand for all (or the only one); 1: the straggler's replica
    rank: int  # pipeline rank of the GPU that sends
    kind: str  # "pp" (activation or gradient to a neighbour stage) or "ag", "rs", "ar" (data parallel)
    name: str
    start: float
    end: float


@dataclass
class StepResult:
    step_time_s: float
    events: list[list[Event]]  # per pipeline rank, the representative replica
    transfers: list[Transfer]
    busy_s: list[float]  # compute per rank (TP/CP collectives included, optimizer excluded)
    optimizer_s: list[float]
    pipeline_span_s: float  # first forward to last backward, the representative replica
    slow_events: list[list[Event]] | None = None

    @property
    def per_rank_idle_fraction(self) -> list[float]:
        """Share of the step each pipeline rank does no compute (bubbles, waiting for transfers)."""
        return [1 - (b + o) / self.step_time_s for b, o in zip(self.busy_s, self.optimizer_s)]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipeline span (first forward to last backward) on the busiest rank: the
        schedule's bubble on the rank that sets the pace. Ranks with less work idle more than this
        (per_rank_idle_fraction); that is load imbalance, not the schedule's."""
        span = self.pipeline_span_s
        return 1 - max(self.busy_s) / span if span > 0 else 0.0


@dataclass
class Comm:
    """What transfers cost on a cluster for one layout: links, and each transfer's bytes, cap and latency."""

    capacity: dict = field(default_factory=dict)
    p2p_bytes: float = 0.0
    p2p: dict = field(default_factory=dict)  # (src rank, dst rank) -> ((out port, in port), cap, latency)
    dp_group: Any = None  # Group
    dp_bw: float = 0.0  # what a DP ring reaches alone (group_bandwidth)
    dp_links: tuple = ()  # (port, share of the ring's bytes) per GPU


def build_comm(
    model, cluster, layout, seq: int, micro_seqs: int, replicas: int, sequence_parallel: bool = True
) -> Comm:
    """Links and transfer costs of `layout` on `cluster`, for `replicas` classes of replica."""
    node, net = cluster.node, cluster.network
    nic = net.nic_bw_gbps * 1e9 * net.nic_efficiency
    nvl = node.intra_bw_gbps * 1e9 * node.intra_efficiency
    comm = Comm()
    for c in range(replicas):
        for r in range(layout.pp):
            comm.capacity.update(
                {("nic_out", c, r): nic, ("nic_in", c, r): nic, ("nvl_out", c, r): nvl, ("nvl_in", c, r): nvl}
            )
    # each TP rank sends its sequence-parallel shard; without SP every TP rank holds (and sends) it all
    comm.p2p_bytes = (
        micro_seqs * seq // layout.cp * model.dim * cluster.dtype_bytes / (layout.tp if sequence_parallel else 1)
    )
    gpu = [layout.rank(pp=r) for r in range(layout.pp)]
    for src in range(layout.pp):
        for dst in range(layout.pp):
            if src == dst:
                continue
            stride = abs(gpu[dst] - gpu[src])
            bw, latency = group_bandwidth(Group(2, stride, layout.world), cluster)
            same_node = gpu[src] // node.gpus == gpu[dst] // node.gpus
            port = ("nvl_out", "nvl_in") if same_node else ("nic_out", "nic_in")
            comm.p2p[(src, dst)] = (port, bw, latency)
    dp_group = shard_group(layout)  # the cp·dp ranks holding the same weights reduce gradients together
    level = group_level(dp_group, cluster)
    comm.dp_group = dp_group
    comm.dp_bw = group_bandwidth(dp_group, cluster)[0]
    if level == "nvlink":
        comm.dp_links = (("nvl_out", 1.0), ("nvl_in", 1.0))
    else:
        # k members per server drive k NICs (one ring channel each): 1/k of the bytes through this GPU's
        # NIC, all of them over its NVLink port to the server's other members.
        k = members_per_node(dp_group, cluster)
        comm.dp_links = (("nic_out", 1 / k), ("nic_in", 1 / k)) + ((("nvl_out", 1.0), ("nvl_in", 1.0)) if k > 1 else ())
    return comm


def _dp_flow(comm: Comm, cluster, op: str, nbytes: float) -> tuple[float, float, float]:
    """(bytes each rank sends, cap, latency) of a data-parallel ring collective on an nbytes buffer;
    alone it takes exactly the planner's collective_time."""
    n = comm.dp_group.size
    volume = ring_bytes_per_rank(op, nbytes, n)
    total = collective_time(op, nbytes, comm.dp_group, cluster)
    return volume, comm.dp_bw, max(0.0, total - volume / comm.dp_bw)


@dataclass
class _Piece:
    action: Action
    part: int  # layer piece index when an action is split into its layers
    parts: int
    dur: float
    needs: tuple
    after: list  # effects when it ends: ("token", t) | ("send", dst, token) | ("enqueue", stream, key)


def simulate(
    schedule: Schedule,
    costs: list[dict[str, float]],
    *,
    layers: list[int] | None = None,
    comm: Comm | None = None,
    cluster=None,
    zero: int = 1,
    dp_bytes: list[float] | None = None,
    optimizer_s: list[float] | None = None,
    slow: tuple[int, float] | None = None,
    dp: int = 1,
) -> StepResult:
    """Run one step. `costs[stage][kind]` are compute seconds; `comm` None makes transfers free.

    `layers[stage]` cuts actions into per-layer pieces where data-parallel buckets gate or follow
    them; `dp_bytes[stage]` are the stage's weight bytes (one DP bucket per layer); `optimizer_s[rank]`
    runs after the rank's last gradient bucket. `slow = (pipeline rank, factor)` slows that rank in
    one of `dp` data-parallel replicas (the others stay the representative class).
    """
    p, n_stages = schedule.pp, schedule.stages
    layers = layers or [1] * n_stages
    optimizer_s = optimizer_s or [0] * p
    classes = [None] if slow is None else ([None, slow] if dp > 1 else [slow])
    with_dp = comm is not None and dp_bytes is not None and comm.dp_group.size > 1
    sim = _Engine(schedule, comm, cluster, len(classes))

    for c, straggler in enumerate(classes):
        for r in range(p):
            factor = straggler[1] if straggler and straggler[0] == r else 1
            sim.pieces[(c, r)] = _rank_pieces(
                schedule, r, c, costs, layers, factor, zero if with_dp else None, sim, dp_bytes
            )
            opt_needs = tuple((c, "coll", key) for key in sim.rs_keys[(c, r)])
            sim.pieces[(c, r)].append(_Piece(Action("O", r, 0), 0, 1, optimizer_s[r] * factor, opt_needs, []))
    return sim.run(classes)


def _rank_pieces(schedule, r, c, costs, layers, factor, zero, sim, dp_bytes):
    """Rank r's compute pieces for replica class c, with the DP buckets they gate and emit."""
    actions = schedule.ranks[r]
    grad_kinds = ("B", "W")
    last_grad = {a.stage: i for i, a in enumerate(actions) if a.kind in grad_kinds}
    first_f = {}
    for i, a in enumerate(actions):
        if a.kind == "F":
            first_f.setdefault(a.stage, i)
    pieces = []
    rs_keys = sim.rs_keys.setdefault((c, r), [])
    if zero in (1, 2):
        for s in sorted(first_f, key=first_f.get):
            for i in range(layers[s]):
                sim.enqueue((c, r, "ag"), ("ag", s, 0, i), dp_bytes[s] / layers[s])
    for idx, a in enumerate(actions):
        s, j = a.stage, a.microbatch
        needs = []
        if a.kind == "F" and s > 0:
            needs.append((c, "act", s - 1, j))
        if a.kind in ("B", "I"):
            needs.append((c, "F", s, j))
            if s < schedule.stages - 1:
                needs.append((c, "gin", s + 1, j))
        if a.kind == "W":
            needs.append((c, "I", s, j))
        gather = zero is not None and (
            (zero in (1, 2) and idx == first_f.get(s)) or (zero == 3 and a.kind in ("F", "B", "I"))
        )
        reduce = zero is not None and a.kind in grad_kinds and (zero >= 2 or idx == last_grad[s])
        parts = layers[s] if (gather or reduce) else 1
        dur = costs[s][a.kind] * factor / parts if parts > 1 else costs[s][a.kind] * factor
        if zero == 3 and gather:
            for i in range(parts):
                sim.enqueue((c, r, "ag"), ("ag", s, j, a.kind, i), dp_bytes[s] / parts)
        for i in range(parts):
            need = tuple(needs) if i == 0 else ()
            if gather:
                key = ("ag", s, 0, i) if zero in (1, 2) else ("ag", s, j, a.kind, i)
                need += ((c, "coll", key),)
            after = []
            if reduce:
                key = ("rs" if zero else "ar", s, j if zero >= 2 else 0, i)
                after.append(("enqueue", (c, r, "rs"), key, dp_bytes[s] / parts))
                rs_keys.append(key)
            if i == parts - 1:
                after.append(("token", (c, a.kind, s, j)))
                if a.kind == "F" and s < schedule.stages - 1:
                    after.append(("send", schedule.stage_rank(s + 1), (c, "act", s, j)))
                if a.kind in ("B", "I") and s > 0:
                    after.append(("send", schedule.stage_rank(s - 1), (c, "gin", s, j)))
            pieces.append(_Piece(a, i, parts, dur, need, after))
    return pieces


class _Engine:
    def __init__(self, schedule: Schedule, comm: Comm | None, cluster, n_classes: int):
        self.schedule, self.comm, self.cluster, self.n_classes = schedule, comm, cluster, n_classes
        self.net = Network(comm.capacity if comm else {})
        self.pieces: dict[tuple, list[_Piece]] = {}
        self.rs_keys: dict[tuple, list] = {}
        self.streams: dict[tuple, deque] = {}
        self.sizes: dict = {}
        self.tokens: set = set()
        self.deliveries: list = []
        self.seq = 0
        self.transfers: list[Transfer] = []
        self.done_colls: dict = {}  # collectives finished, whose streams move on

    def enqueue(self, stream, key, nbytes):
        self.streams.setdefault(stream, deque()).append((key, math.inf))
        self.sizes[key] = nbytes

    def run(self, classes) -> StepResult:
        p = self.schedule.pp
        ranks = [(c, r) for c in range(len(classes)) for r in range(p)]
        pos = dict.fromkeys(ranks, 0)
        running: dict[tuple, tuple[float, _Piece]] = {}
        started: dict[tuple, float] = {}
        events: dict[tuple, list] = {k: [] for k in ranks}
        busy: dict[tuple, Any] = dict.fromkeys(ranks, 0)
        opt: dict[tuple, Any] = dict.fromkeys(ranks, 0)
        # enqueued keys of the rs streams become ready when emitted; ag keys are ready at once
        for stream, q in self.streams.items():
            if stream[2] == "ag":
                self.streams[stream] = deque((key, 0.0) for key, _ in q)
        for c in range(len(classes)):
            for r in range(p):
                self.streams.setdefault((c, r, "rs"), deque())
                self.streams.setdefault((c, r, "ag"), deque())
        waiting_coll: dict = {}  # key -> set of streams whose head it is
        busy_stream: set = set()
        t = 0
        end_time = 0
        while True:
            moved = True
            while moved:
                moved = False
                for k in ranks:
                    if k in running or pos[k] >= len(self.pieces[k]):
                        continue
                    piece = self.pieces[k][pos[k]]
                    if all(n in self.tokens for n in piece.needs):
                        running[k] = (t + piece.dur, piece)
                        if piece.part == 0:
                            started[k] = t
                        moved = True
                for stream, q in self.streams.items():
                    if stream in busy_stream or not q or q[0][1] > t:
                        continue
                    key = q[0][0]
                    waiting_coll.setdefault(key, set()).add(stream)
                    busy_stream.add(stream)
                    if len(waiting_coll[key]) == self.n_classes:
                        self._launch(key, waiting_coll.pop(key), t)
                    moved = True
            nxt = min(
                [e for e, _ in running.values()]
                + [self.net.next_finish(t)]
                + ([self.deliveries[0][0]] if self.deliveries else [])
            )
            if nxt == math.inf:
                break
            for f in self.net.advance(t, nxt - t):
                self._deliver_later(nxt + f.latency, f.done)
            t = nxt
            while self.deliveries and self.deliveries[0][0] <= t:
                _, _, fn = heapq.heappop(self.deliveries)
                fn(t)
            for k in [k for k, (e, _) in running.items() if e <= t]:
                _, piece = running.pop(k)
                a = piece.action
                if a.kind == "O":
                    opt[k] += piece.dur
                else:
                    busy[k] += piece.dur
                    if piece.part == piece.parts - 1:
                        events[k].append(Event(k[1], a.stage, a.kind, a.microbatch, started[k], t))
                end_time = max(end_time, t)
                pos[k] += 1
                for eff in piece.after:
                    self._effect(k, eff, t)
            for streams in self.done_colls.values():
                for stream in streams:
                    self.streams[stream].popleft()
                    busy_stream.discard(stream)
            self.done_colls.clear()
        stuck = [k for k in ranks if pos[k] < len(self.pieces[k])]
        if stuck:
            raise RuntimeError(f"simulation stalled at {stuck[0]}: {self.pieces[stuck[0]][pos[stuck[0]]]}")
        rep = [events[(0, r)] for r in range(p)]
        starts = [e[0].start for e in rep if e]
        ends = [e[-1].end for e in rep if e]
        span = max(ends) - min(starts) if starts else 0.0
        return StepResult(
            end_time,
            rep,
            self.transfers,
            [busy[(0, r)] for r in range(p)],
            [opt[(0, r)] for r in range(p)],
            span,
            [events[(1, r)] for r in range(p)] if len(classes) > 1 else None,
        )

    def _deliver_later(self, when, fn):
        self.seq += 1
        heapq.heappush(self.deliveries, (when, self.seq, fn))

    def _effect(self, k, eff, t):
        c, r = k
        if eff[0] == "token":
            self.tokens.add(eff[1])
        elif eff[0] == "enqueue":
            _, stream, key, nbytes = eff
            self.streams[stream].append((key, t))
            self.sizes[key] = nbytes
        elif eff[0] == "send":
            _, dst, token = eff
            if self.comm is None or dst == r:
                self.tokens.add(token)
                return
            port, bw, latency = self.comm.p2p[(r, dst)]
            links = (((port[0], c, r), 1.0), ((port[1], c, dst), 1.0))
            label = f"{'act' if token[1] == 'act' else 'grad'} {token[2]}.{token[3]} to rank {dst}"

            def done(when, token=token, start=t, label=label):
                self.tokens.add(token)
                self.transfers.append(Transfer(c, r, "pp", label, start, when))

            self.net.add(Flow(self.comm.p2p_bytes, links, bw, latency, done), t)

    def _launch(self, key, streams, t):
        """Every participant has the collective at the head of its stream: move its bytes."""
        op = {"ag": "all_gather", "rs": "reduce_scatter", "ar": "all_reduce"}[key[0]]
        volume, cap, latency = _dp_flow(self.comm, self.cluster, op, self.sizes[key])
        pending = {"n": len(streams)}
        name = f"{op} stage {key[1]} layer {key[-1]}"

        def done(when, stream):
            c, r, _ = stream
            self.transfers.append(Transfer(c, r, key[0], name, t, when))
            pending["n"] -= 1
            if pending["n"] == 0:
                for s in streams:
                    self.tokens.add((s[0], "coll", key))
                self.done_colls[key] = streams

        for stream in streams:
            c, r, _ = stream
            links = tuple(((port, c, r), share) for port, share in self.comm.dp_links)
            self.net.add(Flow(volume, links, cap, latency, lambda when, s=stream: done(when, s)), t)


def simulate_step(
    model,
    cluster,
    layout,
    schedule: Schedule,
    seq: int,
    micro_seqs: int,
    *,
    zero: int = 1,
    recompute: str = "none",
    comm: bool = True,
    slow_gpu: tuple[int, float] | None = None,
    throttle: float = 1.0,
    sequence_parallel: bool = True,
) -> StepResult:
    """One step of `model` on `cluster` with `layout` and `schedule`, microbatches of micro_seqs sequences.

    `slow_gpu = (global rank, factor)`: that GPU computes factor× slower, and with it its TP/CP group
    (they meet in every layer's collectives). `throttle` ≥ 1 slows every GPU's compute alike.
    """
    if schedule.pp != layout.pp:
        raise FourdError(f"schedule for pp={schedule.pp} but layout {layout} has pp={layout.pp}")
    v = schedule.virtual_stages
    costs = [
        {k: t * throttle for k, t in c.items()}
        for c in stage_costs(model, cluster, layout, seq, micro_seqs, v, recompute, comm, sequence_parallel)
    ]
    counts = stage_layers(model.layers, layout.pp, v)
    dtype = cluster.dtype_bytes
    dp_bytes = [stage_params(model, counts, s) / layout.tp * dtype for s in range(len(counts))]
    optimizer = []
    for r in range(layout.pp):
        params = sum(dp_bytes[s] for s in schedule.stages_of_rank(r)) / dtype
        owned = params / (shard_group(layout).size if zero >= 1 else 1)
        optimizer.append(optimizer_time(owned, cluster) * throttle)
    slow = None
    if slow_gpu is not None:
        g, factor = slow_gpu
        if not 0 <= g < layout.world:
            raise FourdError(f"--slow-gpu {g}:{factor}: rank {g} is outside 0..{layout.world - 1} of layout {layout}")
        if not factor > 0:
            raise FourdError(f"--slow-gpu {g}:{factor}: the factor must be positive, e.g. 1.2 for 20 % slower")
        slow = (layout.coords(g)["pp"], factor)
    replicas = 1 if slow is None or layout.dp == 1 else 2
    net = build_comm(model, cluster, layout, seq, micro_seqs, replicas, sequence_parallel) if comm else None
    return simulate(
        schedule,
        costs,
        layers=[max(1, n) for n in counts],
        comm=net,
        cluster=cluster,
        zero=zero,
        dp_bytes=dp_bytes,
        optimizer_s=optimizer,
        slow=slow,
        dp=layout.dp,
    )
