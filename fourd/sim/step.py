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
from fourd.plan.cluster import (
    group_bandwidth,
    group_level,
    members_per_node,
    send_latency,
    shard_group,
)
from fourd.plan.job import Job
from fourd.plan.kernels import collective_time, optimizer_time
from fourd.plan.memory import stage_params
from fourd.plan.perf import chunk_times, tied_embedding_sync, weight_passes
from fourd.schedules import Action, Schedule, build_schedule, depends_on
from fourd.sim.network import Flow, Network

MAX_PIECES = 200_000  # compute pieces one simulation may run: about 20 s of simulation
# Backward twice forward (two GEMMs per forward one); a split backward is half input, half weight.
UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True, kw_only=True)
class Event:
    rank: int
    stage: int
    kind: str  # "F", "B", "I", "W"
    microbatch: int
    start: float
    end: float


def stage_costs(job: Job, comm: bool = True) -> list[dict[str, float]]:
    """Seconds of each action kind ("F", "B", "I", "W") per global stage from the planner's cost
    model; TP and CP collectives are part of F, B and I unless `comm` is False, and under autocast
    over FP32 weights each stage's casts and gradient sums, and the FP32 gradient sum a stack makes
    apart, are part of F and W (fourd.plan.perf.weight_passes). B = I + W: a full backward is the
    input-gradient half and the weight-gradient half (Qi et al. 2023, §2)."""
    costs = []
    params = stage_params_on_gpu(job)
    for stage, chunk in enumerate(chunk_times(job)):
        chunk = chunk + weight_passes(job, params[stage])  # casts and gradient sums
        forward = chunk.forward_s
        input_grad = chunk.input_grad_s
        if comm:
            forward += chunk.forward_comm_s
            input_grad += chunk.backward_comm_s
        weight_grad = chunk.weight_grad_s
        costs.append(
            {"F": forward, "I": input_grad, "W": weight_grad, "B": input_grad + weight_grad}
        )
    return costs


@dataclass(frozen=True, kw_only=True)
class Transfer:
    replica: int  # 0: the replicas that stand for all (or the only one); 1: the straggler's replica
    rank: int  # pipeline rank of the GPU that sends
    # "pp" (activation or gradient to a neighbour stage) or "ag", "rs", "ar" (data parallel)
    kind: str
    name: str
    start: float
    end: float


@dataclass(kw_only=True)
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
        """Each rank's share of the step without compute: bubbles, waiting for transfers."""
        return [
            1 - (busy + optimizer) / self.step_time_s
            for busy, optimizer in zip(self.busy_s, self.optimizer_s)
        ]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipeline span on the busiest rank: 1 - busy / span."""
        if self.pipeline_span_s <= 0:
            return 0.0
        return 1 - max(self.busy_s) / self.pipeline_span_s


@dataclass(frozen=True, kw_only=True)
class Comm:
    """What transfers cost on a cluster for one job: links, and each transfer's bytes, cap and
    latency."""

    cluster: Any
    zero: int
    capacity: dict  # bytes/s of each port's links (port, replica class, rank)
    p2p_bytes: float  # bytes of one activation (or its gradient) between neighbour stages
    p2p: dict  # (src rank, dst rank) -> ((out port, in port), cap in bytes/s, latency in s)
    dp_group: Any  # the cp·dp ranks holding the same weights reduce gradients together
    dp_bw: float  # bytes/s a DP ring reaches alone (group_bandwidth)
    dp_links: tuple  # (port, share of the ring's bytes) per GPU
    dp_params: list  # each stage's parameters on one GPU (one bucket per layer)
    embedding_params: float = 0.0  # of them, the first stage's input embedding on one GPU
    weight_bytes: int  # per parameter: weights move in the compute precision
    grad_bytes: int  # per parameter: gradients in the stack's reduction precision (FP32 or BF16)
    gather_in_step: bool = False  # ZeRO 1 and 2 gather after the optimizer's update, not beside F
    # gradient bytes a DDP bucket holds (the stack's dp_bucket_mb); 0: one reduction a layer
    bucket_bytes: float = 0.0


def build_comm(job: Job) -> Comm:
    """Links and transfer costs of the job's layout on its cluster. A link's bandwidth is the
    cluster's GB/s × 1e9 × its measured efficiency, in bytes/s."""
    cluster = job.cluster
    lay = job.layout
    node = cluster.node
    net = cluster.network
    nic_bw = net.nic_bw_gbps * 1e9 * net.nic_efficiency
    nvlink_bw = node.intra_bw_gbps * 1e9 * node.intra_efficiency
    # each TP rank sends its sequence-parallel shard; without SP every TP rank holds (and sends)
    # all of it
    sp_shards = 1
    if job.par.sequence_parallel:
        sp_shards = lay.tp
    p2p_bytes = job.work.tokens * job.model.dim * job.dtype_bytes / sp_shards
    # the first rank of each pipeline stage, as the stack numbers its ranks (cluster.RANK_ORDERS)
    stage_stride = job.work.groups["pp"].stride
    server = [pp_rank * stage_stride // node.gpus for pp_rank in range(lay.pp)]
    link = {  # same server: NVLink; else the NICs
        True: (("nvl_out", "nvl_in"), nvlink_bw, send_latency(cluster, across_servers=False)),
        False: (("nic_out", "nic_in"), nic_bw, send_latency(cluster, across_servers=True)),
    }
    p2p = {
        (src, dst): link[server[src] == server[dst]]
        for src in range(lay.pp)
        for dst in range(lay.pp)
    }
    group = shard_group(lay, order=job.work.rank_order)
    nvlink_links = (("nvl_out", 1.0), ("nvl_in", 1.0))
    # k members per server drive k NICs (one ring channel each): 1/k of the bytes through this
    # GPU's NIC, all of them over its NVLink port to the server's other members
    members = members_per_node(group, cluster)
    nic_links: tuple = (("nic_out", 1 / members), ("nic_in", 1 / members))
    if members > 1:
        nic_links += nvlink_links
    if group_level(group, cluster) == "nvlink":
        dp_links = nvlink_links
    else:
        dp_links = nic_links
    return Comm(
        cluster=cluster,
        zero=job.par.zero,
        capacity={"nic_out": nic_bw, "nic_in": nic_bw, "nvl_out": nvlink_bw, "nvl_in": nvlink_bw},
        p2p_bytes=p2p_bytes,
        p2p=p2p,
        dp_group=group,
        dp_bw=group_bandwidth(group, cluster)[0],
        dp_links=dp_links,
        dp_params=stage_params_on_gpu(job),
        embedding_params=job.model.embedding_params() / lay.tp,
        weight_bytes=job.state_dtype_bytes,
        grad_bytes=job.grad_reduce_bytes,
        gather_in_step=job.gathers_in_step,
        bucket_bytes=job.grad_reduce_bytes * job.bucket_params,
    )


def stage_params_on_gpu(job: Job) -> list[float]:
    """Parameters of each pipeline stage on one GPU (what its data-parallel buckets move)."""
    counts = job.stage_layers
    return [stage_params(job.model, counts, stage) / job.layout.tp for stage in range(len(counts))]


@dataclass(slots=True, kw_only=True)
class _Piece:
    action: Action
    part: int  # layer piece index when an action is split into its layers
    parts: int
    dur: float  # seconds
    needs: tuple  # the tokens it waits for
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
    pp_ranks = schedule.pp
    layers = layers or [1] * schedule.stages
    optimizer_s = optimizer_s or [0] * pp_ranks
    # replica classes: None for the replicas that stand for all, `slow` for the straggler's
    if slow is None:
        classes: list = [None]
    elif dp > 1:
        classes = [None, slow]
    else:
        classes = [slow]
    actions = [action for rank_actions in schedule.ranks for action in rank_actions]
    _check_size(len(classes) * sum(layers[action.stage] for action in actions))
    zero = None  # no data-parallel collectives
    if comm is not None and comm.dp_group.size > 1:
        zero = comm.zero
    sim = _Engine(schedule, comm, len(classes))
    for replica, straggler in enumerate(classes):
        for rank in range(pp_ranks):
            factor = 1
            if straggler and straggler[0] == rank:
                factor = straggler[1]
            gpu = (replica, rank)
            sim.pieces[gpu] = _rank_pieces(sim, gpu, costs, layers, factor, zero)
            optimizer_step = _Piece(
                action=Action("O", rank, 0),
                part=0,
                parts=1,
                dur=optimizer_s[rank] * factor,
                needs=tuple((replica, "coll", key) for key in sim.rs_keys[gpu]),
                after=[],
            )
            sim.pieces[gpu].append(optimizer_step)
            if zero in (1, 2) and comm is not None and comm.gather_in_step:
                sim.pieces[gpu] += _gather_after_update(sim, gpu, optimizer_step, layers)
    return sim.run()


def _gather_after_update(sim: _Engine, who: tuple[int, int], update: _Piece, layers) -> list:
    """ZeRO 1 and 2 on a stack that gathers inside the optimizer's step: the update enqueues the
    all-gather of each of the rank's stages' weights, layer by layer, and the step ends when the
    last arrives (an empty piece that waits for them all)."""
    comm = sim.comm
    assert comm is not None
    keys = []
    for stage in sim.schedule.stages_of_rank(who[1]):
        layer_bytes = comm.dp_params[stage] * comm.weight_bytes / layers[stage]
        for layer in range(layers[stage]):
            key = ("ag", stage, 0, layer)
            update.after.append(("enqueue", (*who, "ag"), key, layer_bytes))
            keys.append((who[0], "coll", key))
    if not keys:
        return []
    return [_Piece(action=update.action, part=0, parts=1, dur=0, needs=tuple(keys), after=[])]


def _check_size(pieces: int) -> None:
    if pieces > MAX_PIECES:
        raise FourdError(
            f"this step has {pieces:,} compute pieces to simulate, more than {MAX_PIECES:,}: use "
            "fewer microbatches, virtual stages or pipeline ranks"
        )


def _needs(action: Action, replica: int, stages: int) -> list:
    """Tokens an action waits for (fourd.schedules.depends_on): deliveries are "act" and "gin"
    tokens."""
    needs = []
    for kind, stage, microbatch in depends_on(action, stages):
        if action.kind == "F":
            kind = "act"  # the previous stage's activation, delivered
        elif kind == "grad":
            kind = "gin"  # the next stage's input gradient, delivered
        needs.append((replica, kind, stage, microbatch))
    return needs


def _dp_bytes(comm) -> tuple[list, list]:
    """Per stage, the bytes of its weights (as the DP collectives move them) and of its gradients
    (in the stack's reduction precision); none without communication."""
    params = comm.dp_params if comm else []
    weight_bytes = [count * comm.weight_bytes for count in params]
    grad_bytes = [count * comm.grad_bytes for count in params]
    return weight_bytes, grad_bytes


def _stage_marks(actions) -> tuple[dict, dict]:
    """Per stage, the index of its first forward and of its last backward (B or W) among a rank's
    actions."""
    first_forward: dict = {}
    last_grad: dict = {}
    for index, action in enumerate(actions):
        if action.kind == "F":
            first_forward.setdefault(action.stage, index)
        if action.kind in ("B", "W"):
            last_grad[action.stage] = index
    return first_forward, last_grad


def _rank_pieces(sim: _Engine, who: tuple[int, int], costs, layers, factor, zero):
    """A rank's compute pieces for one replica class, with the DP buckets they gate and emit."""
    replica, rank = who
    schedule = sim.schedule
    comm = sim.comm
    actions = schedule.ranks[rank]
    weight_bytes, grad_bytes = _dp_bytes(comm)
    # the input embedding's gradient, on the first stage
    embedding_bytes = comm.grad_bytes * comm.embedding_params if comm else 0.0
    first_forward, last_grad = _stage_marks(actions)
    pieces = []
    rs_keys = sim.rs_keys.setdefault(who, [])
    gathered_before = zero in (1, 2) and not (comm and comm.gather_in_step)
    # a DDP stack's ZeRO 0 or 1 reduces its gradients in buckets of a size, as its backward fills them
    buckets = None
    if comm and comm.bucket_bytes and zero in (0, 1):
        buckets = _Buckets(comm.bucket_bytes, "rs" if zero else "ar", rank)
    last_reduce = max(last_grad.values(), default=-1)
    if gathered_before:
        _prefetch_weights(
            sim,
            who,
            sorted(first_forward, key=lambda stage: first_forward[stage]),
            layers,
            weight_bytes,
        )
    for index, action in enumerate(actions):
        stage = action.stage
        gather = zero is not None and (
            (gathered_before and index == first_forward.get(stage))
            or (zero == 3 and action.kind != "W")
        )
        reduce = (
            zero is not None
            and action.kind in ("B", "W")
            and (zero >= 2 or index == last_grad[stage])
        )
        parts = 1
        if gather or reduce:
            parts = layers[stage]
        dur = costs[stage][action.kind] * factor
        if parts > 1:  # whole-number costs of unsplit actions stay ints
            dur /= parts
        for part in range(parts):
            piece = _Piece(action=action, part=part, parts=parts, dur=dur, needs=(), after=[])
            if part == 0:
                piece.needs = tuple(_needs(action, replica, schedule.stages))
            if gather:
                piece.needs += (_gather_need(sim, who, piece, weight_bytes[stage], zero),)
            if reduce:
                last = index == last_reduce and part == parts - 1
                embedding = embedding_bytes if stage == 0 else 0.0
                gradients = _piece_gradients(grad_bytes[stage], embedding, part, parts)
                for key, nbytes in _reductions(action, part, zero, gradients, buckets, last):
                    piece.after.append(("enqueue", (replica, rank, "rs"), key, nbytes))
                    rs_keys.append(key)
            if part == parts - 1:
                piece.after += _action_done(schedule, replica, action)
            pieces.append(piece)
    return pieces


def _piece_gradients(stage_bytes: float, embedding_bytes: float, part: int, parts: int) -> float:
    """Gradient bytes a backward piece (a layer) hands to the DP reductions: the stage's
    layers share its `stage_bytes`, except that the first stage's input embedding
    (`embedding_bytes`, 0 on the others), whose gradient the backward computes last, comes with its
    last piece."""
    share = (stage_bytes - embedding_bytes) / parts
    if part == parts - 1:
        return share + embedding_bytes
    return share


class _Buckets:
    """A rank's DDP gradient buckets, filled in the order its backward produces the gradients: each
    full bucket is reduced at once, what is left when the last gradient arrives reduced with it."""

    def __init__(self, capacity: float, kind: str, rank: int):
        self.capacity = capacity  # gradient bytes a bucket holds (the stack's reduction precision)
        self.kind = kind  # "ar" (ZeRO 0's all-reduce) or "rs" (ZeRO 1's reduce-scatter)
        self.rank = rank  # the pipeline rank whose buckets these are
        self.pending = 0.0  # gradient bytes waiting for a bucket to fill
        self.count = 0  # buckets reduced so far

    def fill(self, nbytes: float, last: bool) -> list[tuple[tuple, float]]:
        """The buckets (key, bytes) that `nbytes` more gradients fill; with `last`, the rest too."""
        self.pending += nbytes
        full = []
        while self.pending >= self.capacity or (last and self.pending > 0):
            size = min(self.capacity, self.pending)
            full.append(((self.kind, "bucket", self.rank, self.count), size))
            self.pending -= size
            self.count += 1
        return full


def _prefetch_weights(sim: _Engine, who: tuple[int, int], stages, layers, weight_bytes) -> None:
    """ZeRO-1 and -2: all-gather each stage's weights, layer by layer, in the order of the stages'
    first forwards."""
    for stage in stages:
        for i in range(layers[stage]):
            sim.enqueue((*who, "ag"), ("ag", stage, 0, i), weight_bytes[stage] / layers[stage])


def _gather_need(sim: _Engine, who: tuple[int, int], piece: _Piece, weight_bytes, zero) -> tuple:
    """The all-gather of its layer's weights that a piece waits for: ZeRO-1 and -2 gather each
    stage's weights once, before its first forward; ZeRO-3 before every F, B and I."""
    action = piece.action
    if zero in (1, 2):
        return (who[0], "coll", ("ag", action.stage, 0, piece.part))
    key = ("ag", action.stage, action.microbatch, action.kind, piece.part)
    sim.enqueue((*who, "ag"), key, weight_bytes / piece.parts)
    return (who[0], "coll", key)


def _reductions(
    action: Action, part: int, zero: int, gradients: float, buckets: _Buckets | None, last: bool
) -> list[tuple[tuple, float]]:
    """The (key, bytes) of the DP reductions a piece's `gradients` bytes start: its layer's own, or
    the DDP buckets they fill (`last`: the rank's last gradients, which reduce what is left)."""
    if buckets is not None:
        return buckets.fill(gradients, last)
    return [(_reduce_key(action, part, zero), gradients)]


def _reduce_key(action: Action, part: int, zero: int) -> tuple:
    """The gradient bucket a piece emits: DDP (ZeRO 0) all-reduces and ZeRO-1 reduce-scatters once
    per step, after the stage's last backward; ZeRO-2 and -3 reduce-scatter every microbatch."""
    kind = "ar"
    if zero:
        kind = "rs"
    microbatch = 0
    if zero >= 2:
        microbatch = action.microbatch
    return (kind, action.stage, microbatch, part)


def _action_done(schedule: Schedule, replica: int, action: Action) -> list:
    """What the last piece of an action does when it ends: its token, and the activation sent to
    the next stage (after F) or the input gradient to the previous one (after B or I)."""
    stage = action.stage
    microbatch = action.microbatch
    effects: list = [("token", (replica, action.kind, stage, microbatch))]
    if action.kind == "F" and stage < schedule.stages - 1:
        effects.append(
            ("send", schedule.stage_rank(stage + 1), (replica, "act", stage, microbatch))
        )
    if action.kind in ("B", "I") and stage > 0:
        effects.append(
            ("send", schedule.stage_rank(stage - 1), (replica, "gin", stage, microbatch))
        )
    return effects


class _Engine:
    """The event loop: compute pieces run on their GPUs; activations, gradients and DP collectives
    move as flows over the shared links."""

    def __init__(self, schedule: Schedule, comm: Comm | None, n_classes: int):
        self.schedule = schedule
        self.comm = comm
        self.n_classes = n_classes  # replica classes: 1, or 2 with the straggler's replica
        capacity: dict = {}
        if comm:
            capacity = comm.capacity
        self.net = Network(capacity)
        # every simulated GPU: (replica class, pipeline rank)
        self.ranks = [
            (replica, rank) for replica in range(n_classes) for rank in range(schedule.pp)
        ]
        # GPU -> its compute pieces in execution order
        self.pieces: dict[tuple, list[_Piece]] = {}
        # (replica class, rank, "ag" | "rs") -> its queue of (collective key, ready time)
        self.streams: dict[tuple, deque] = {}
        if comm:
            for replica, rank in self.ranks:
                for kind in ("ag", "rs"):
                    self.streams[(replica, rank, kind)] = deque()
        # GPU -> the gradient collectives its optimizer step waits for
        self.rs_keys: dict[tuple, list] = {}
        # collective key -> bytes each member moves
        self.sizes: dict[Any, float] = {}
        # finished actions, delivered activations and gradients, finished collectives
        self.tokens: set[Any] = set()
        # every transfer that moved, for the trace
        self.transfers: list[Transfer] = []
        # tie-breaker of deliveries at the same time: first in, first delivered
        self.order = itertools.count()
        # (time, order, callback): flows delivered after their latency, FIFO at a tie
        self.deliveries: list = []
        # collectives finished this instant, collective key -> the streams whose head it is (they
        # move on)
        self.done_colls: dict[Any, Any] = {}
        # collective key -> the streams that hold it at their head, waiting for the other members
        self.waiting: dict[Any, set] = {}
        # streams whose head collective waits or runs
        self.busy_streams: set[tuple] = set()
        # GPU -> index of its next piece
        self.pos: dict[tuple, int] = dict.fromkeys(self.ranks, 0)
        # GPU -> (end time, piece) of the piece it runs
        self.running: dict[tuple, tuple] = {}
        # GPU -> start time of its current action (its first piece's start)
        self.started: dict[tuple, float] = {}

    def enqueue(self, stream, key, nbytes, ready: float = 0.0):
        self.streams[stream].append((key, ready))
        self.sizes[key] = nbytes

    def _start(self, now: float) -> None:
        """Start every piece whose inputs are there and every collective at the head of all its
        streams."""
        moved = True
        while moved:
            moved = False
            for gpu in self.ranks:
                if gpu in self.running or self.pos[gpu] >= len(self.pieces[gpu]):
                    continue
                piece = self.pieces[gpu][self.pos[gpu]]
                if all(token in self.tokens for token in piece.needs):
                    self.running[gpu] = (now + piece.dur, piece)
                    if piece.part == 0:
                        self.started[gpu] = now
                    moved = True
            for stream, queue in self.streams.items():
                if stream in self.busy_streams or not queue or queue[0][1] > now:
                    continue
                key = queue[0][0]
                self.waiting.setdefault(key, set()).add(stream)
                self.busy_streams.add(stream)
                if len(self.waiting[key]) == self.n_classes:
                    self._launch(key, self.waiting.pop(key), now)
                moved = True

    def run(self) -> StepResult:
        events: dict[tuple, list] = {gpu: [] for gpu in self.ranks}
        busy = dict[tuple, Any].fromkeys(self.ranks, 0)  # compute seconds per GPU
        optimizer = dict[tuple, Any].fromkeys(self.ranks, 0)  # optimizer seconds per GPU
        now = end_time = cast(Any, 0)  # ints stay exact with whole-number costs
        while True:
            self._start(now)
            ends = [end for end, _ in self.running.values()] + [self.net.next_finish(now)]
            if self.deliveries:
                ends.append(self.deliveries[0][0])
            then = min(ends)
            if then == math.inf:
                break
            for flow in self.net.advance(now, then - now):
                delivery = (then + flow.latency, next(self.order), flow.done)
                heapq.heappush(self.deliveries, delivery)
            now = then
            while self.deliveries and self.deliveries[0][0] <= now:
                heapq.heappop(self.deliveries)[2](now)
            for gpu in [gpu for gpu, (end, _) in self.running.items() if end <= now]:
                self._finish(gpu, now, events, busy, optimizer)
                end_time = max(end_time, now)
            for streams in self.done_colls.values():
                for stream in streams:
                    self.streams[stream].popleft()
                    self.busy_streams.discard(stream)
            self.done_colls.clear()
        stuck = [gpu for gpu in self.ranks if self.pos[gpu] < len(self.pieces[gpu])]
        if stuck:
            raise RuntimeError(
                f"simulation stalled at {stuck[0]}: {self.pieces[stuck[0]][self.pos[stuck[0]]]}"
            )
        pp_ranks = range(self.schedule.pp)
        representative = [events[(0, rank)] for rank in pp_ranks]
        starts = [rank_events[0].start for rank_events in representative if rank_events]
        ends = [rank_events[-1].end for rank_events in representative if rank_events]
        slow_events = None
        if self.n_classes > 1:
            slow_events = [events[(1, rank)] for rank in pp_ranks]
        span = 0.0
        if starts:
            span = max(ends) - min(starts)
        return StepResult(
            step_time_s=end_time,
            events=representative,
            transfers=self.transfers,
            busy_s=[busy[(0, rank)] for rank in pp_ranks],
            optimizer_s=[optimizer[(0, rank)] for rank in pp_ranks],
            pipeline_span_s=span,
            slow_events=slow_events,
        )

    def _finish(self, gpu: tuple, now, events: dict, busy: dict, optimizer: dict) -> None:
        """The piece `gpu` runs ends at `now`: count its seconds, record its action's event when it
        is the last piece, apply its effects."""
        piece = self.running.pop(gpu)[1]
        action = piece.action
        if action.kind == "O":
            optimizer[gpu] += piece.dur
        else:
            busy[gpu] += piece.dur
        if action.kind != "O" and piece.part == piece.parts - 1:
            event = Event(
                rank=gpu[1],
                stage=action.stage,
                kind=action.kind,
                microbatch=action.microbatch,
                start=self.started[gpu],
                end=now,
            )
            events[gpu].append(event)
        self.pos[gpu] += 1
        for effect in piece.after:
            self._effect(gpu, effect, now)

    def _effect(self, gpu, effect, now):
        replica, rank = gpu
        if effect[0] == "token":
            self.tokens.add(effect[1])
        elif effect[0] == "enqueue":
            self.enqueue(effect[1], effect[2], effect[3], ready=now)
        elif self.comm is None or effect[1] == rank:
            self.tokens.add(effect[2])
        else:
            _, dst, token = effect
            port, bandwidth, latency = self.comm.p2p[(rank, dst)]
            links = (((port[0], replica, rank), 1.0), ((port[1], replica, dst), 1.0))
            what = "grad"
            if token[1] == "act":
                what = "act"
            label = f"{what} {token[2]}.{token[3]} to rank {dst}"

            def done(when, token=token, start=now, label=label):
                self.tokens.add(token)
                transfer = Transfer(
                    replica=replica, rank=rank, kind="pp", name=label, start=start, end=when
                )
                self.transfers.append(transfer)

            flow = Flow(
                size=self.comm.p2p_bytes, links=links, cap=bandwidth, latency=latency, done=done
            )
            self.net.add(flow, now)

    def _launch(self, key, streams, now):
        """Every participant has the collective at the head of its stream: move its bytes (a ring
        over the DP group; alone it takes exactly the planner's collective_time). Each GPU moves
        bus_factor × bytes; the latency is what collective_time adds beyond volume / bandwidth."""
        comm = self.comm
        assert comm is not None
        op = {"ag": "all_gather", "rs": "reduce_scatter", "ar": "all_reduce"}[key[0]]
        nbytes = self.sizes[key]
        members = comm.dp_group.size
        volume = bus_factor(op, members) * nbytes
        ring_s = collective_time(op, nbytes, comm.dp_group, comm.cluster)
        latency = max(0.0, ring_s - volume / comm.dp_bw)
        pending = {"n": len(streams)}
        name = f"{op} stage {key[1]} layer {key[-1]}"
        if key[1] == "bucket":  # a DDP bucket: (kind, "bucket", pipeline rank, index)
            name = f"{op} bucket {key[3]} of pipeline rank {key[2]}"

        def done(when, stream):
            transfer = Transfer(
                replica=stream[0], rank=stream[1], kind=key[0], name=name, start=now, end=when
            )
            self.transfers.append(transfer)
            pending["n"] -= 1
            if pending["n"] == 0:
                for member in streams:
                    self.tokens.add((member[0], "coll", key))
                self.done_colls[key] = streams

        for stream in streams:
            links = tuple(((port, stream[0], stream[1]), share) for port, share in comm.dp_links)
            flow = Flow(
                size=volume,
                links=links,
                cap=comm.dp_bw,
                latency=latency,
                done=lambda when, member=stream: done(when, member),
            )
            self.net.add(flow, now)


def _check_simulable(job: Job) -> None:
    """Refuse, in one line each, what the engine does not run and the planner models: pipeline sends
    other than overlapped, data-parallel traffic after the backward, HSDP replica groups of ZeRO 1
    or 2, and ZeRO 1 or 2's gradients all-reduced or weights broadcast rank by rank."""
    lay, par = job.layout, job.par
    if job.pipeline_sends != "overlapped" and lay.pp > 1:
        raise FourdError(
            f"the step simulator runs overlapped pipeline communication only, not "
            f"{job.pipeline_sends} (stack {job.stack}), which the planner models: use `fourd plan` "
            "or --pipeline-comm overlapped"
        )
    if not job.dp_overlapped and not job.cluster.cpu:
        raise FourdError(
            f"the step simulator overlaps data-parallel traffic with compute only; stack "
            f"{job.stack} reduces after the backward, which the planner models: use `fourd plan` "
            "or --dp-overlap on"
        )
    if par.hsdp and par.zero != 3:
        raise FourdError(
            f"the step simulator runs HSDP with ZeRO 3 only, not {par.hsdp_replicas} replica groups "
            f"of ZeRO {par.zero}, which the planner models: use `fourd plan` or --zero 3"
        )
    if par.zero in (1, 2) and (job.reduces_whole_gradients or job.broadcasts_weights):
        raise FourdError(
            f"the step simulator reduce-scatters ZeRO {par.zero}'s gradients and all-gathers its "
            f"weights only; stack {job.stack} runs {job.shard_reduce} and {job.weight_gather}, which "
            "the planner models: use `fourd plan` or --zero 0"
        )


def simulate_step(
    job: Job, comm: bool = True, slow_gpu: tuple[int, float] | None = None, throttle: float = 1.0
):
    """One step of `job` (a StepResult). `slow_gpu = (global rank, factor)`: that GPU, and with it
    its TP/CP group, computes factor× slower; `throttle` ≥ 1 slows every GPU alike."""
    lay, par = job.layout, job.par
    _check_simulable(job)
    layers = [max(1, count) for count in job.stage_layers]
    # before building: F and B per layer and microbatch, or F, I and W with zero bubble
    kinds = 2
    if par.schedule == "zero-bubble":
        kinds = 3
    _check_size(par.microbatches * sum(layers) * kinds)
    schedule = build_schedule(par.schedule, lay.pp, par.microbatches, par.virtual_stages)
    costs = [
        {kind: seconds * throttle for kind, seconds in stage_cost.items()}
        for stage_cost in stage_costs(job, comm)
    ]
    gpu, factor = slow_gpu or (0, 1.0)
    if not (0 <= gpu < lay.world and 0 < factor < math.inf):
        raise FourdError(
            f"slow GPU {gpu}:{factor}: give a rank in 0..{lay.world - 1} of layout "
            f"{lay} and a factor > 0"
        )
    slow = None
    if slow_gpu is not None:
        slow = (lay.coords(gpu)["pp"], factor)
    net = None
    if comm:
        net = build_comm(job)
    params = stage_params_on_gpu(job)
    owned = 1  # ZeRO 0 keeps the whole optimizer state on every replica
    if par.zero >= 1:
        owned = shard_group(lay).size
    optimizer = [
        optimizer_time(
            sum(params[stage] for stage in schedule.stages_of_rank(rank)) / owned,
            job.cluster,
            job.state_dtype_bytes,
        )
        * throttle
        for rank in range(lay.pp)
    ]
    if comm:  # before their update, the first and last stage sum a tied embedding's gradients
        for rank in {0, lay.pp - 1}:
            optimizer[rank] += tied_embedding_sync(job)
    return simulate(
        schedule, costs, layers=layers, comm=net, optimizer_s=optimizer, slow=slow, dp=lay.dp
    )


def timeline(schedule: Schedule, costs: dict | list[dict] | None = None) -> list[list[Event]]:
    """Per-rank timed events in execution order, times from 0, transfers free (the lab's pipeline
    bench): `costs` seconds by kind (UNIT, the default), or a list of such dicts, one per stage."""
    if not isinstance(costs, list):
        costs = [costs or UNIT] * schedule.stages
    return simulate(schedule, costs).events


def idle_fractions(events: list[list[Event]]) -> tuple[float, list[float]]:
    """The step time (first start to last end over all ranks) and each rank's idle share of it:
    (step - busy) / step."""
    last_end = max(rank_events[-1].end for rank_events in events if rank_events)
    first_start = min(rank_events[0].start for rank_events in events if rank_events)
    step = last_end - first_start
    return step, [
        (step - sum(x.end - x.start for x in rank_events)) / step for rank_events in events
    ]
