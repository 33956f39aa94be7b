"""Cluster profiles (TOML, docs/planner.md): a GPU, a server, a pod and the network, not a size;
presets in fourd/plan/clusters/, user profiles in $FOURD_HOME/clusters/ (they win), or a path. And
where a group lands."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

import tomllib

from fourd.config import fourd_home
from fourd.errors import FourdError, did_you_mean
from fourd.layout import PRECISIONS

PRESET_DIR = Path(__file__).parent / "clusters"
DTYPE_BYTES = dict(zip(PRECISIONS, (2, 4)))
# FP8 training as Transformer Engine runs it: the transformer layers' GEMMs take FP8 inputs (E4M3
# forward, E5M2 gradients) at the FP8 tensor rate; activations, communication, attention, the output
# layer and the loss stay BF16. The planner's precisions: the trainer's and this one.
FP8 = "fp8"
PLAN_PRECISIONS = (*PRECISIONS, FP8)


@dataclass(frozen=True)
class GemmSample:  # a measured (m×k)·(k×n) GEMM
    m: int
    n: int
    k: int
    tflops: float


@dataclass(frozen=True)
class AttentionSample:
    # measured, in the planner's FLOPs; masked_*: an explicit mask, all seq² pairs computed
    seq: int
    head_dim: int
    fwd_tflops: float
    bwd_tflops: float
    masked_fwd_tflops: float | None = None
    masked_bwd_tflops: float | None = None


@dataclass(frozen=True)
class CollectiveSample:
    # a measured fit: time = alpha_s + beta_s_per_byte · bytes (bytes as nccl-tests count)
    op: str
    nproc: int
    alpha_s: float
    beta_s_per_byte: float


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float  # dense peak in the training precision (datasheet; CPU profiles: measured)
    memory_gb: float
    hbm_bw_gbps: float
    fp8_peak_tflops: float | None = None  # dense FP8 peak (datasheet); None: no FP8 tensor cores
    sms: int | None = None  # streaming multiprocessors, for wave quantization; None on CPUs
    gemm_efficiency: float = 0.7  # sustained fraction of peak on large GEMMs
    # FP8 GEMMs' share of the FP8 peak over BF16 GEMMs' share of the BF16 peak, as measured
    # maximum achievable matmul rates give it (docs/planner.md, "FP8 GEMMs"); 1: as BF16's
    fp8_gemm_share: float = 1.0
    # FlashAttention-2's share of peak on long sequences at head dim 128; None: as GEMMs of that shape
    attention_fwd_efficiency: float | None = None
    attention_bwd_efficiency: float | None = None
    # cuDNN's fused attention (Transformer Engine's FusedAttention, the kernel a stack with
    # `fused_attention = "cudnn"` runs); None: the GPU has no such figures, the flash ones serve
    cudnn_attention_fwd_efficiency: float | None = None
    cudnn_attention_bwd_efficiency: float | None = None
    memory_reserve_gb: float = 0.0  # the runtime's own: CUDA context, NCCL's buffers
    gemm: tuple[GemmSample, ...] = ()  # measured square GEMMs
    gemm_shapes: tuple[
        GemmSample, ...
    ] = ()  # measured at training shapes (m, n, k as the planner names them)
    attention: tuple[AttentionSample, ...] = ()
    elementwise_gbps: float | None = (
        None  # measured eager block ops, in fourd.plan.block's counted bytes/s
    )
    optimizer_gbps: float | None = (
        None  # measured AdamW, one parameter at a time: planner-counted bytes/s
    )
    tp_layer_us: float = (
        0.0  # measured: CPU time tensor parallelism adds to a layer's forward and backward
    )
    fsdp_layer_us: float = 0.0  # measured: CPU time FSDP adds to a layer's forward and backward


@dataclass(frozen=True)
class Node:
    gpus: int
    intra_bw_gbps: float
    intra_latency_us: float = 5.0  # one ring step between GPUs of a server
    call_latency_us: float = 0.0  # what every collective call costs before its first step
    intra_efficiency: float = 1.0  # fraction of the link rate a collective reaches
    concurrent_ranks: int | None = (
        None  # ranks that compute at full speed at once (CPU cores); None: all
    )
    # CPU profiles: the compute two workers lose waiting for each other at their collectives, as a
    # share of the compute between them (measured by fourd calibrate); 0: none. `sync_share` with
    # TP's pattern (an all-reduce after every GEMM pair), `fsdp_sync_share` with FSDP's (a gather
    # before each layer's forward, a scatter after its backward); None: as `sync_share`
    sync_share: float = 0.0
    fsdp_sync_share: float | None = None

    @property
    def layer_sync_share(self) -> float:
        """The share lost by ranks that synchronize at most once a layer each way (FSDP's gathers
        and scatters, CP's, a pipeline's sends): `fsdp_sync_share`, or `sync_share` where the
        profile was written before calibrate measured it apart."""
        if self.fsdp_sync_share is None:
            return self.sync_share
        return self.fsdp_sync_share


@dataclass(frozen=True)
class Network:
    nic_bw_gbps: float
    latency_us: float = 10.0
    nic_efficiency: float = 1.0
    gpus_per_rack: int = 16
    gpus_per_pod: int = 3072  # full bisection inside a pod
    cross_pod_oversubscription: float = 1.0  # a pod's NICs over its uplinks to other pods


@dataclass(
    frozen=True, eq=False
)  # identity hash: the time model caches on it, and hashing every field is slow
class Cluster:
    name: str
    description: str
    gpu: GPU
    node: Node
    network: Network
    dtype: str = "bf16"  # the profile's training precision (CPU profiles: fp32)
    collectives: tuple[CollectiveSample, ...] = ()
    source: str = ""

    @property
    def cpu(self) -> bool:
        """A CPU profile (`fourd calibrate`): ranks share cores; it describes what `fourd train`
        runs here."""
        return self.node.concurrent_ranks is not None

    def core_share(self, ranks: int) -> float:
        """How many times slower each rank runs while `ranks` of them are busy on one server (CPU
        profiles: they take turns on the cores, collectives too, since a CPU copies and reduces
        their data itself; GPUs: 1)."""
        slots = self.node.concurrent_ranks
        return max(1.0, min(ranks, self.node.gpus) / slots) if slots else 1.0


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.toml"))


def _find(name_or_path: str) -> Path:
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        if not Path(name_or_path).is_file():
            raise FourdError(
                f"cluster {name_or_path}: no such file; give a preset name or a path to a .toml "
                "profile"
            )
        return Path(name_or_path)
    for folder in (fourd_home() / "clusters", PRESET_DIR):
        if (folder / f"{name_or_path}.toml").is_file():
            return folder / f"{name_or_path}.toml"
    hint = " (run `fourd calibrate` to write it)" if name_or_path == "local" else ""
    raise FourdError(
        f"unknown cluster {name_or_path!r}{hint or did_you_mean(name_or_path, preset_names())}: "
        f"choose one of {', '.join(preset_names())}, a profile in {fourd_home() / 'clusters'}, or "
        "a path to a .toml file"
    )


# Numbers that may be zero (every other one must be above zero), each of its field's type.
MAY_BE_ZERO = {
    "alpha_s",
    "memory_reserve_gb",
    "tp_layer_us",
    "fsdp_layer_us",
    "intra_latency_us",
    "call_latency_us",
    "sync_share",
    "fsdp_sync_share",
    "latency_us",
}
_TYPES = {"int": (int,), "float": (int, float), "str": (str,)}


def _section(cls, data, where: str, path: Path):
    """`cls` from a TOML table: every key known, every value of its field's type, numbers finite, in
    range."""
    if not isinstance(data, dict):
        raise FourdError(f"{path}: [{where}] must be a table; see docs/planner.md for the schema")
    fields = cls.__dataclass_fields__
    if bad := ", ".join(sorted(set(data) - set(fields))):
        raise FourdError(
            f"{path}: unknown key(s) {bad} in [{where}]; allowed: {', '.join(sorted(fields))}"
        )
    for key, value in data.items():
        kind = _TYPES.get(
            str(fields[key].type).split(" ")[0]
        )  # None: the tuples of samples, read apart
        if kind and (isinstance(value, bool) or not isinstance(value, kind)):
            raise FourdError(
                f"{path}: {where}.{key} = {value!r} must be of type {kind[-1].__name__}"
            )
        zero = key in MAY_BE_ZERO
        if (
            kind
            and kind != (str,)
            and not (math.isfinite(value) and (value >= 0 if zero else value > 0))
        ):
            bound = "above"
            if zero:
                bound = "at least"
            raise FourdError(f"{path}: {where}.{key} = {value} must be finite, {bound} 0")
    try:
        return cls(**data)
    except TypeError as e:
        raise FourdError(
            f"{path}: [{where}] is incomplete ({e}); see docs/planner.md for the schema"
        ) from None


def load_cluster(name_or_path: str) -> Cluster:
    """The profile called `name_or_path` (user profiles first, then presets) or the profile at that
    path."""
    path = _find(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise FourdError(
            f"{path}: not a readable TOML profile ({e}); fix it or rerun `fourd calibrate`"
        ) from None
    for key in ("gpu", "node", "network"):
        if not isinstance(data.get(key), dict):
            raise FourdError(
                f"{path}: missing the [{key}] table; see docs/planner.md for the schema"
            )
    gpu = dict(data["gpu"])
    for key, cls in (
        ("gemm", GemmSample),
        ("gemm_shapes", GemmSample),
        ("attention", AttentionSample),
    ):
        gpu[key] = tuple(
            _section(cls, sample_table, f"gpu.{key}", path) for sample_table in gpu.get(key, ())
        )
    if data.get("dtype", "bf16") not in DTYPE_BYTES:
        raise FourdError(f"{path}: dtype = {data['dtype']!r}; allowed: {', '.join(DTYPE_BYTES)}")
    collectives = tuple(
        _section(CollectiveSample, sample, "collectives", path)
        for sample in data.get("collectives", ())
    )
    return Cluster(
        name=str(data.get("name", path.stem)),
        description=str(data.get("description", "")),
        gpu=_section(GPU, gpu, "gpu", path),
        node=_section(Node, data["node"], "node", path),
        network=_section(Network, data["network"], "network", path),
        dtype=data.get("dtype", "bf16"),
        collectives=collectives,
        source=str(path),
    )


# ---- where a parallel group lands ----------------------------------------------------------------

LEVELS = ("single", "nvlink", "rack", "pod", "cross-pod")
# How a stack numbers its ranks, innermost dimension first: fourd's and Llama 3's [TP, CP, PP, DP]
# (Dubey et al. 2024, §3.3.2: data parallelism outermost, where latency matters least), or the data-
# parallel ranks inside each pipeline stage, the pipeline outermost: Megatron-Core's default order
# "tp-cp-ep-dp-pp" (megatron/core/parallel_state.py, initialize_model_parallel), DeepSpeed's pipeline
# topology (axes pipe, data, model), torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp] and
# nanotron's process groups (ranks reshaped to pp, dp, tp)
RANK_ORDERS = ("tp-cp-pp-dp", "tp-cp-dp-pp")


@dataclass(frozen=True)
class Group:
    """Ranks base, base+stride, ..., base+(size-1)·stride of `world` ranks, placed in order (rank r
    on server r // gpus_per_node). Every rank belongs to one such group per dimension."""

    size: int
    stride: int
    world: int


@lru_cache(maxsize=4096)
def _spread(group: Group, cluster: Cluster) -> tuple[dict[str, int], int]:
    """(how many of the dimension's groups lie inside one server, rack or pod, or across pods; the
    fewest members a group that spans servers has on one of them). A group's place depends on its
    first rank modulo the blocks' common multiple, so one period of first ranks is counted, each as
    often as it recurs."""
    sizes = (cluster.node.gpus, cluster.network.gpus_per_rack, cluster.network.gpus_per_pod)
    blocks = tuple(zip(LEVELS[1:], sizes))  # the innermost level a group fits in wins
    node_gpus, reach, span = sizes[0], (group.size - 1) * group.stride, group.size * group.stride
    period, groups = math.lcm(*sizes), group.world // span
    cycle = period // math.gcd(span, period)
    counts: dict[str, int] = {}
    fewest = group.size
    for k in range(min(groups, cycle) if group.size > 1 else 0):
        recurs = (groups - 1 - k) // cycle + 1  # how often a first rank k·span (mod period) recurs
        for offset in range(min(group.stride, period)):
            first = k * span + offset
            last_rank = first + reach
            times = recurs * ((group.stride - 1 - offset) // period + 1)
            level = "cross-pod"
            for name, block in blocks:
                if first // block == last_rank // block:
                    level = name
                    break
            counts[level] = counts.get(level, 0) + times
            if level != "nvlink" and group.stride < node_gpus:
                # members on its first and on its last server
                last = -(-(last_rank // node_gpus * node_gpus - first) // group.stride)
                fewest = min(
                    fewest,
                    -(-((first // node_gpus + 1) * node_gpus - first) // group.stride),
                    group.size - last,
                )
    return counts, 1 if group.stride >= node_gpus else fewest


def group_levels(group: Group, cluster: Cluster) -> dict[str, int]:
    """How many of a dimension's groups lie inside one server ("nvlink"), one rack, one pod, or
    across pods ("cross-pod"), each where its ranks are: with tp=3 on 8-GPU servers some TP groups
    straddle two servers."""
    return dict(_spread(group, cluster)[0])


def group_level(group: Group, cluster: Cluster) -> str:
    """The widest part of the topology any of the dimension's groups crosses (they meet each step:
    the slowest rules)."""
    return max(group_levels(group, cluster), key=LEVELS.index, default="single")


def members_per_node(group: Group, cluster: Cluster) -> int:
    """The fewest members a group spanning servers has on one server: its ring's NICs there carry
    its traffic."""
    return _spread(group, cluster)[1]


@lru_cache(maxsize=16384)
def group_bandwidth(
    group: Group, cluster: Cluster, channels: int | None = None
) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, per-step latency in s) of a ring over the group: NVLink inside a
    server; across servers each of the k members per server drives its own NIC (one ring channel
    each, as NCCL does; `channels` k if given), k·NIC capped by NVLink; across pods all crossing
    channels share the uplinks."""
    node, net = cluster.node, cluster.network
    intra = node.intra_bw_gbps * 1e9 * node.intra_efficiency
    level = group_level(group, cluster)
    if level in ("single", "nvlink"):
        return intra, node.intra_latency_us * 1e-6
    per_node, nic = (
        channels or members_per_node(group, cluster),
        net.nic_bw_gbps * 1e9 * net.nic_efficiency,
    )
    if level == "cross-pod":
        crossing = (
            min(group.world, net.gpus_per_pod)
            / max(1, min(group.size, net.gpus_per_pod // group.stride))
            * per_node
        )
        nic = min(nic, net.gpus_per_pod * nic / net.cross_pod_oversubscription / crossing)
    return min(intra, per_node * nic), net.latency_us * 1e-6


def servers_spanned(group: Group, cluster: Cluster) -> int:
    """How many servers a group's ranks lie on (its widest instance): one inside a server, else its
    size over the fewest members it has on one server."""
    if group_level(group, cluster) in ("single", "nvlink"):
        return 1
    return max(2, math.ceil(group.size / members_per_node(group, cluster)))


def send_latency(cluster: Cluster, across_servers: bool) -> float:
    """Seconds a send takes besides moving its bytes: the call's base latency and one step on the
    link it crosses, NVLink inside a server or the network between two (`collective_latency`)."""
    step_us = cluster.network.latency_us if across_servers else cluster.node.intra_latency_us
    return (cluster.node.call_latency_us + step_us) * 1e-6


@lru_cache(maxsize=16384)
def collective_latency(op: str, group: Group, cluster: Cluster) -> float:
    """Seconds a collective on `group` takes besides moving its bytes: a base latency per call
    (NCCL 2.19-2.21's tuning model, `src/graph/tuning.cc`: `baseLat`, ring, Simple protocol), then
    each step at the latency of the link it crosses (its `hwLat` for the ring: NVLink inside a
    server, the network between servers). On n ranks over k servers a ring reduce-scatter or
    all-gather takes n − 1 steps, k − 1 of them between servers, as NCCL counts them; a send one
    step. An all-reduce is counted as the depth of a double binary tree, 2·⌈log2 n⌉ steps, 2·⌈log2 k⌉
    of them between servers, at the ring's step latencies: fewer than NCCL's own count of its ring
    or tree all-reduce (docs/planner.md, "Examined and left out: NCCL's own all-reduce latencies")."""
    node, net = cluster.node, cluster.network
    servers = servers_spanned(group, cluster)
    if op == "send":
        return send_latency(cluster, across_servers=servers > 1)
    if op == "all_reduce":
        steps = 2 * math.ceil(math.log2(group.size))
        crossing = 2 * math.ceil(math.log2(servers))
    else:
        steps, crossing = group.size - 1, servers - 1
    inside = steps - crossing
    return (
        node.call_latency_us + crossing * net.latency_us + inside * node.intra_latency_us
    ) * 1e-6


@lru_cache(maxsize=4096)
def placement(layout, order: str = RANK_ORDERS[0]) -> Mapping[str, Group]:
    """The group of each parallel dimension, ranks laid out innermost first in `order` (one of
    RANK_ORDERS): each dimension's stride is the product of the degrees inside it. Read-only: the
    planner asks for the same layout's groups thousands of times in a search, and they are kept."""
    groups, stride = {}, 1
    for dim in order.split("-"):
        degree = getattr(layout, dim)
        groups[dim] = Group(degree, stride, layout.world)
        stride *= degree
    return MappingProxyType({dim: groups[dim] for dim in ("tp", "cp", "pp", "dp")})


def dp_inside_pp(order: str) -> bool:
    """Whether `order` lays the data-parallel ranks out inside each pipeline stage (Megatron's)."""
    return order.index("dp") < order.index("pp")


def shard_group(layout, replicas: int = 1, order: str = RANK_ORDERS[0]) -> Group:
    """The cp·dp ranks that hold the same weights: they reduce gradients together and ZeRO shards
    over them (FSDP over dp×cp, as the trainer and Llama 3 do), or over 1/`replicas` of them with
    HSDP. With the DP ranks inside each pipeline stage (`order`) they are adjacent blocks of TP
    groups; with them outside, one ring spread evenly over the DP group's span (exact when cp or dp
    is 1)."""
    if layout.dp == 1:
        return Group(layout.cp, layout.tp, layout.world)
    if dp_inside_pp(order):
        return Group(layout.cp * layout.dp // replicas, layout.tp, layout.world)
    return Group(layout.cp * layout.dp // replicas, layout.tp * layout.pp, layout.world)


def replica_group(layout, replicas: int, order: str = RANK_ORDERS[0]) -> Group:
    """HSDP: the ranks holding the same shard in each of the `replicas` groups (the outermost part
    of the data-parallel dimension)."""
    # the ranks of one pipeline stage, or all of them
    span = layout.world // layout.pp if dp_inside_pp(order) else layout.world
    return Group(replicas, span // replicas, layout.world)
