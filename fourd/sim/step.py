"""Discrete-event simulation of one training step: each pipeline rank runs its `fourd.schedules`
actions with the planner's compute times; activations, gradients and per-layer data-parallel buckets
move as flows sharing the links (fourd.sim.network). One GPU per pipeline rank stands for its
replicas (docs/simulators.md)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

from fourd.comm import bus_factor
from fourd.errors import FourdError
from fourd.plan.cluster import group_bandwidth, group_level, members_per_node, shard_group
from fourd.plan.job import Job, stage_layers
from fourd.plan.kernels import collective_time, optimizer_time
from fourd.plan.memory import stage_params
from fourd.plan.perf import chunk_times
from fourd.schedules import Action, Schedule, build_schedule, depends_on
from fourd.sim.network import Flow, Network

MAX_PIECES = 200_000  # compute pieces one simulation may run: about 20 s of simulation
# Backward twice forward (two GEMMs per forward one); a split backward is half input, half weight.
UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Event:
    rank: int
    stage: int
    kind: str  # "F", "B", "I", "W"
    microbatch: int
    start: float
    end: float


def stage_costs(job: Job, comm: bool = True) -> list[dict[str, float]]:
    """Seconds of each action kind ("F", "B", "I", "W") per global stage from the planner's cost
    model; TP and CP collectives are part of F, B and I unless `comm` is False."""
    times = [
        (
            t.forward_s + t.forward_comm_s * comm,
            t.input_grad_s + t.backward_comm_s * comm,
            t.weight_grad_s,
        )
        for t in chunk_times(job)
    ]
    return [{"F": f, "I": i, "W": w, "B": i + w} for f, i, w in times]


@dataclass(frozen=True)
class Transfer:
    replica: int  # 0: the replicas that stand for all (or the only one); 1: the straggler's replica
    rank: int  # pipeline rank of the GPU that sends
    # "pp" (activation or gradient to a neighbour stage) or "ag", "rs", "ar" (data parallel)
    kind: str
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
    def per_rank_idle_fraction(self) -> list[float]:  # no compute: bubbles, waiting for transfers
        return [1 - (b + o) / self.step_time_s for b, o in zip(self.busy_s, self.optimizer_s)]

    @property
    def bubble_fraction(self) -> float:  # idle share of the pipeline span on the busiest rank
        return 1 - max(self.busy_s) / self.pipeline_span_s if self.pipeline_span_s > 0 else 0.0


@dataclass(frozen=True)
class Comm:
    """What transfers cost on a cluster for one job: links, and each transfer's bytes, cap and
    latency."""

    cluster: Any
    zero: int
    capacity: dict  # bytes/s of each port's links (port, replica class, rank)
    p2p_bytes: float
    p2p: dict  # (src rank, dst rank) -> ((out port, in port), cap, latency)
    dp_group: Any  # the cp·dp ranks holding the same weights reduce gradients together
    dp_bw: float  # what a DP ring reaches alone (group_bandwidth)
    dp_links: tuple  # (port, share of the ring's bytes) per GPU
    dp_params: list  # each stage's parameters on one GPU (one bucket per layer)
    weight_bytes: int  # per parameter: weights move in the compute precision, gradients in FP32


def build_comm(job: Job) -> Comm:
    """Links and transfer costs of the job's layout on its cluster."""
    cluster, lay, node, net = job.cluster, job.layout, job.cluster.node, job.cluster.network
    nic, nvl = (
        net.nic_bw_gbps * 1e9 * net.nic_efficiency,
        node.intra_bw_gbps * 1e9 * node.intra_efficiency,
    )
    # each TP rank sends its sequence-parallel shard; without SP every TP rank holds (and sends) it
    # all
    p2p_bytes = (
        job.work.tokens
        * job.model.dim
        * job.dtype_bytes
        / (lay.tp if job.par.sequence_parallel else 1)
    )
    server = [lay.rank(pp=r) // node.gpus for r in range(lay.pp)]
    link = {
        True: (("nvl_out", "nvl_in"), nvl, node.intra_latency_us * 1e-6),
        False: (("nic_out", "nic_in"), nic, net.latency_us * 1e-6),
    }
    p2p = {(a, b): link[server[a] == server[b]] for a in range(lay.pp) for b in range(lay.pp)}
    group, nvlink = shard_group(lay), (("nvl_out", 1.0), ("nvl_in", 1.0))
    # k members per server drive k NICs (one ring channel each): 1/k of the bytes through this GPU's
    # NIC, all of them over its NVLink port to the server's other members
    k = members_per_node(group, cluster)
    nic_links = (("nic_out", 1 / k), ("nic_in", 1 / k)) + nvlink * (k > 1)
    dp_links = nvlink if group_level(group, cluster) == "nvlink" else nic_links
    return Comm(
        cluster,
        job.par.zero,
        {"nic_out": nic, "nic_in": nic, "nvl_out": nvl, "nvl_in": nvl},
        p2p_bytes,
        p2p,
        group,
        group_bandwidth(group, cluster)[0],
        dp_links,
        stage_params_on_gpu(job),
        job.dtype_bytes,
    )


def stage_params_on_gpu(job: Job) -> list[float]:
    """Parameters of each pipeline stage on one GPU (what its data-parallel buckets move)."""
    counts = stage_layers(job.model.layers, job.layout.pp, job.par.virtual_stages)
    return [stage_params(job.model, counts, s) / job.layout.tp for s in range(len(counts))]


@dataclass(slots=True)
class _Piece:
    action: Action
    part: int  # layer piece index when an action is split into its layers
    parts: int
    dur: float
    needs: tuple
    # effects when it ends: ("token", t) | ("send", dst, token) | ("enqueue", stream, key, bytes)
    after: list


def simulate(
    schedule: Schedule,
    costs: list[dict[str, float]],
    *,
    layers: list[int] | None = None,
    comm: Comm | None = None,
    optimizer_s: list[float] | None = None,
    slow: tuple[int, float] | None = None,
    dp: int = 1,
) -> StepResult:
    """Run one step: `costs[stage][kind]` compute seconds, `layers[stage]` DP buckets per stage,
    `comm` None: transfers free, no DP collectives; `slow = (pipeline rank, factor)` slows it in one
    of `dp` replicas."""
    p = schedule.pp
    layers = layers or [1] * schedule.stages
    optimizer_s = optimizer_s or [0] * p
    classes = [None] if slow is None else ([None, slow] if dp > 1 else [slow])
    _check_size(len(classes) * sum(layers[a.stage] for r in schedule.ranks for a in r))
    zero = comm.zero if comm is not None and comm.dp_group.size > 1 else None
    sim = _Engine(schedule, comm, len(classes))
    for c, straggler in enumerate(classes):
        for r in range(p):
            factor = straggler[1] if straggler and straggler[0] == r else 1
            sim.pieces[(c, r)] = _rank_pieces(sim, (c, r), costs, layers, factor, zero)
            needs = tuple((c, "coll", key) for key in sim.rs_keys[(c, r)])
            sim.pieces[(c, r)].append(
                _Piece(Action("O", r, 0), 0, 1, optimizer_s[r] * factor, needs, [])
            )
    return sim.run()


def _check_size(pieces: int) -> None:
    if pieces > MAX_PIECES:
        raise FourdError(
            f"this step has {pieces:,} compute pieces to simulate, more than {MAX_PIECES:,}: use "
            "fewer microbatches, virtual stages or pipeline ranks"
        )


def _needs(a: Action, c: int, stages: int) -> list:
    """Tokens an action waits for (fourd.schedules.depends_on): deliveries are "act" and "gin"
    tokens."""
    return [
        (c, "act" if a.kind == "F" else "gin" if k == "grad" else k, s, j)
        for k, s, j in depends_on(a, stages)
    ]


def _rank_pieces(sim: _Engine, who: tuple[int, int], costs, layers, factor, zero):
    """A rank's compute pieces for one replica class, with the DP buckets they gate and emit."""
    c, r = who
    schedule, comm, actions = sim.schedule, sim.comm, sim.schedule.ranks[r]
    params = comm.dp_params if comm else []
    weights, grads = (
        [n * comm.weight_bytes for n in params] if comm else [],
        [4 * n for n in params],
    )
    last_grad = {a.stage: i for i, a in enumerate(actions) if a.kind in ("B", "W")}
    first_f = {
        a.stage: i for i, a in reversed(list(enumerate(actions))) if a.kind == "F"
    }  # the first wins
    pieces, rs_keys = [], sim.rs_keys.setdefault(who, [])
    if zero in (1, 2):
        for s in sorted(first_f, key=lambda s: first_f[s]):
            for i in range(layers[s]):
                sim.enqueue((c, r, "ag"), ("ag", s, 0, i), weights[s] / layers[s])
    for idx, a in enumerate(actions):
        s, j = a.stage, a.microbatch
        gather = zero is not None and (
            (zero in (1, 2) and idx == first_f.get(s)) or (zero == 3 and a.kind != "W")
        )
        reduce = zero is not None and a.kind in ("B", "W") and (zero >= 2 or idx == last_grad[s])
        parts = layers[s] if (gather or reduce) else 1
        dur = (
            costs[s][a.kind] * factor / parts if parts > 1 else costs[s][a.kind] * factor
        )  # ints stay exact
        for i in range(parts):
            if zero == 3 and gather:
                sim.enqueue((c, r, "ag"), ("ag", s, j, a.kind, i), weights[s] / parts)
            need = tuple(_needs(a, c, schedule.stages)) if i == 0 else ()
            if gather:
                need += (
                    (c, "coll", ("ag", s, 0, i) if zero in (1, 2) else ("ag", s, j, a.kind, i)),
                )
            after: list = []
            if reduce:
                key = ("rs" if zero else "ar", s, j if zero >= 2 else 0, i)
                after.append(("enqueue", (c, r, "rs"), key, grads[s] / parts))  # gradients in FP32
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
    def __init__(self, schedule: Schedule, comm: Comm | None, n_classes: int):
        self.schedule, self.comm, self.n_classes = schedule, comm, n_classes
        self.net = Network(comm.capacity if comm else {})
        self.ranks = [(c, r) for c in range(n_classes) for r in range(schedule.pp)]
        self.pieces: dict[tuple, list[_Piece]] = {}
        self.streams: dict[tuple, deque] = {
            (c, r, s): deque() for c, r in self.ranks for s in ("ag", "rs") if comm
        }
        self.rs_keys, self.sizes, self.tokens = dict[tuple, list](), dict[Any, float](), set[Any]()
        self.transfers, self.order = list[Transfer](), itertools.count()
        # (time, order, callback): flows delivered after their latency, FIFO at a tie
        self.deliveries: list = []
        # collectives finished (their streams move on), collective key -> the streams whose head it
        # is
        self.done_colls, self.waiting, self.busy_streams = (
            dict[Any, Any](),
            dict[Any, set](),
            set[tuple](),
        )
        self.pos, self.running, self.started = (
            dict.fromkeys(self.ranks, 0),
            dict[tuple, tuple](),
            dict[tuple, float](),
        )

    def enqueue(self, stream, key, nbytes, ready: float = 0.0):
        self.streams[stream].append((key, ready))
        self.sizes[key] = nbytes

    def _start(self, t: float) -> None:
        """Start every piece whose inputs are there and every collective at the head of all its
        streams."""
        moved = True
        while moved:
            moved = False
            for k in self.ranks:
                idle = k not in self.running and self.pos[k] < len(self.pieces[k])
                piece = self.pieces[k][self.pos[k]] if idle else None
                if piece and all(n in self.tokens for n in piece.needs):
                    self.running[k] = (t + piece.dur, piece)
                    self.started[k] = t if piece.part == 0 else self.started[k]
                    moved = True
            for stream, q in self.streams.items():
                if stream in self.busy_streams or not q or q[0][1] > t:
                    continue
                key = q[0][0]
                self.waiting.setdefault(key, set()).add(stream)
                self.busy_streams.add(stream)
                if len(self.waiting[key]) == self.n_classes:
                    self._launch(key, self.waiting.pop(key), t)
                moved = True

    def run(self) -> StepResult:
        events: dict[tuple, list] = {k: [] for k in self.ranks}
        busy, opt = (
            dict[tuple, Any].fromkeys(self.ranks, 0),
            dict[tuple, Any].fromkeys(self.ranks, 0),
        )
        t = end_time = cast(Any, 0)  # ints stay exact with whole-number costs
        while True:
            self._start(t)
            ends = [e for e, _ in self.running.values()] + [self.net.next_finish(t)]
            nxt = min(ends + ([self.deliveries[0][0]] if self.deliveries else []))
            if nxt == math.inf:
                break
            for f in self.net.advance(t, nxt - t):
                heapq.heappush(self.deliveries, (nxt + f.latency, next(self.order), f.done))
            t = nxt
            while self.deliveries and self.deliveries[0][0] <= t:
                heapq.heappop(self.deliveries)[2](t)
            for k in [k for k, (e, _) in self.running.items() if e <= t]:
                piece = self.running.pop(k)[1]
                a = piece.action
                (opt if a.kind == "O" else busy)[k] += piece.dur
                if a.kind != "O" and piece.part == piece.parts - 1:
                    events[k].append(Event(k[1], a.stage, a.kind, a.microbatch, self.started[k], t))
                end_time = max(end_time, t)
                self.pos[k] += 1
                for eff in piece.after:
                    self._effect(k, eff, t)
            for streams in self.done_colls.values():
                for stream in streams:
                    self.streams[stream].popleft()
                    self.busy_streams.discard(stream)
            self.done_colls.clear()
        stuck = [k for k in self.ranks if self.pos[k] < len(self.pieces[k])]
        if stuck:
            raise RuntimeError(
                f"simulation stalled at {stuck[0]}: {self.pieces[stuck[0]][self.pos[stuck[0]]]}"
            )
        p = self.schedule.pp
        rep = [events[(0, r)] for r in range(p)]
        starts, ends = [e[0].start for e in rep if e], [e[-1].end for e in rep if e]
        slow = [events[(1, r)] for r in range(p)] if self.n_classes > 1 else None
        span = max(ends) - min(starts) if starts else 0.0
        mine = [(busy[(0, r)], opt[(0, r)]) for r in range(p)]
        return StepResult(
            end_time, rep, self.transfers, [b for b, _ in mine], [o for _, o in mine], span, slow
        )

    def _effect(self, k, eff, t):
        c, r = k
        if eff[0] == "token":
            self.tokens.add(eff[1])
        elif eff[0] == "enqueue":
            self.enqueue(eff[1], eff[2], eff[3], ready=t)
        elif self.comm is None or eff[1] == r:
            self.tokens.add(eff[2])
        else:
            _, dst, token = eff
            port, bw, latency = self.comm.p2p[(r, dst)]
            links = (((port[0], c, r), 1.0), ((port[1], c, dst), 1.0))
            label = f"{'act' if token[1] == 'act' else 'grad'} {token[2]}.{token[3]} to rank {dst}"

            def done(when, token=token, start=t, label=label):
                self.tokens.add(token)
                self.transfers.append(Transfer(c, r, "pp", label, start, when))

            self.net.add(Flow(self.comm.p2p_bytes, links, bw, latency, done), t)

    def _launch(self, key, streams, t):
        """Every participant has the collective at the head of its stream: move its bytes (a ring
        over the DP group; alone it takes exactly the planner's collective_time)."""
        comm = self.comm
        assert comm is not None
        op = {"ag": "all_gather", "rs": "reduce_scatter", "ar": "all_reduce"}[key[0]]
        nbytes, n = self.sizes[key], comm.dp_group.size
        volume = bus_factor(op, n) * nbytes
        latency = max(
            0.0, collective_time(op, nbytes, comm.dp_group, comm.cluster) - volume / comm.dp_bw
        )
        pending = {"n": len(streams)}
        name = f"{op} stage {key[1]} layer {key[-1]}"

        def done(when, stream):
            self.transfers.append(Transfer(stream[0], stream[1], key[0], name, t, when))
            pending["n"] -= 1
            if pending["n"] == 0:
                for s in streams:
                    self.tokens.add((s[0], "coll", key))
                self.done_colls[key] = streams

        for stream in streams:
            links = tuple(((port, stream[0], stream[1]), share) for port, share in comm.dp_links)
            self.net.add(
                Flow(volume, links, comm.dp_bw, latency, lambda when, s=stream: done(when, s)), t
            )


def simulate_step(
    job: Job, comm: bool = True, slow_gpu: tuple[int, float] | None = None, throttle: float = 1.0
):
    """One step of `job` (a StepResult). `slow_gpu = (global rank, factor)`: that GPU, and with it
    its TP/CP group, computes factor× slower; `throttle` ≥ 1 slows every GPU alike."""
    lay, par = job.layout, job.par
    if job.pipeline_comm != "overlapped":
        raise FourdError(
            "the step simulator runs overlapped pipeline communication only; the "
            "planner models blocking"
        )
    layers = [max(1, n) for n in stage_layers(job.model.layers, lay.pp, par.virtual_stages)]
    _check_size(
        par.microbatches * sum(layers) * (3 if par.schedule == "zero-bubble" else 2)
    )  # before building
    schedule = build_schedule(par.schedule, lay.pp, par.microbatches, par.virtual_stages)
    costs = [{k: t * throttle for k, t in c.items()} for c in stage_costs(job, comm)]
    g, factor = slow_gpu or (0, 1.0)
    if not (0 <= g < lay.world and 0 < factor < math.inf):
        raise FourdError(
            f"slow GPU {g}:{factor}: give a rank in 0..{lay.world - 1} of layout "
            f"{lay} and a factor > 0"
        )
    slow = None if slow_gpu is None else (lay.coords(g)["pp"], factor)
    net = build_comm(job) if comm else None
    params, owned = stage_params_on_gpu(job), shard_group(lay).size if par.zero >= 1 else 1
    optimizer = [
        optimizer_time(
            sum(params[s] for s in schedule.stages_of_rank(r)) / owned, job.cluster, job.dtype_bytes
        )
        * throttle
        for r in range(lay.pp)
    ]
    return simulate(
        schedule, costs, layers=layers, comm=net, optimizer_s=optimizer, slow=slow, dp=lay.dp
    )


def timeline(schedule: Schedule, costs: dict | list[dict] | None = None) -> list[list[Event]]:
    """Per-rank timed events in execution order, times from 0, transfers free (the lab's pipeline
    bench): `costs` seconds by kind (UNIT, the default), or a list of such dicts, one per stage."""
    return simulate(
        schedule, costs if isinstance(costs, list) else [costs or UNIT] * schedule.stages
    ).events


def idle_fractions(events: list[list[Event]]) -> tuple[float, list[float]]:
    """The step time (first start to last end over all ranks) and each rank's idle share of it."""
    step = max(e[-1].end for e in events if e) - min(e[0].start for e in events if e)
    return step, [(step - sum(x.end - x.start for x in e)) / step for e in events]
