"""Cluster profiles: what one accelerator can do, how a server, a pod and the network connect them, and
where a parallel group of ranks lands in that topology. A profile describes hardware, not a size: any
number of GPUs may be asked of it (more than one pod's worth spread over several pods).

Profiles are TOML files (schema in docs/planner.md): presets in `fourd/plan/clusters/<name>.toml`,
user profiles in `$FOURD_HOME/clusters/<name>.toml` (they win over presets; `fourd calibrate` writes
`local` there), or any path to a .toml file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import tomllib

from fourd.config import fourd_home
from fourd.errors import FourdError
from fourd.layout import PRECISIONS

PRESET_DIR = Path(__file__).parent / "clusters"
DTYPE_BYTES = dict(zip(PRECISIONS, (2, 4)))


@dataclass(frozen=True)
class GemmSample:
    """A measured GEMM: (m×k)·(k×n) at `tflops`."""

    m: int
    n: int
    k: int
    tflops: float


@dataclass(frozen=True)
class AttentionSample:
    """Measured attention: `seq` queries against as many keys per head of `head_dim`, at these rates in the
    planner's FLOPs (4·pairs·head_dim forward, 2.5 times that backward; causal: seq²/2 pairs). `masked_*`:
    an explicit mask (context parallelism's chunk layout on CPUs), every one of the seq² pairs computed."""

    seq: int
    head_dim: int
    fwd_tflops: float
    bwd_tflops: float
    masked_fwd_tflops: float | None = None
    masked_bwd_tflops: float | None = None


@dataclass(frozen=True)
class CollectiveSample:
    """A measured collective fit: time = alpha_s + beta_s_per_byte · bytes (bytes as nccl-tests count them)."""

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
    sms: int | None = None  # streaming multiprocessors, for wave quantization; None on CPUs
    gemm_efficiency: float = 0.7  # sustained fraction of peak on large GEMMs
    attention_fwd_efficiency: float | None = None  # fused attention kernels; None: as GEMMs of that shape
    attention_bwd_efficiency: float | None = None
    memory_reserve_gb: float = 0.0  # what the runtime keeps for itself
    gemm: tuple[GemmSample, ...] = ()
    gemm_shapes: tuple[GemmSample, ...] = ()  # measured at training shapes (m, n, k as the planner names them)
    attention: tuple[AttentionSample, ...] = ()
    elementwise_gbps: float | None = None  # measured eager norms, RoPE, SiLU·mul, adds: planner-counted bytes/s
    optimizer_gbps: float | None = None  # measured AdamW, one parameter at a time: planner-counted bytes/s


@dataclass(frozen=True)
class Node:
    gpus: int
    intra_bw_gbps: float
    intra_latency_us: float = 5.0
    intra_efficiency: float = 1.0  # fraction of the link rate a collective reaches
    concurrent_ranks: int | None = None  # ranks that compute at full speed at once (CPU cores); None: all


@dataclass(frozen=True)
class Network:
    nic_bw_gbps: float
    latency_us: float = 10.0
    nic_efficiency: float = 1.0
    gpus_per_rack: int = 16
    gpus_per_pod: int = 3072  # full bisection inside a pod
    cross_pod_oversubscription: float = 1.0  # uplinks between pods, as a fraction of the pod's NICs


@dataclass(frozen=True, eq=False)  # identity hash: the time model caches on it, and hashing every field is slow
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
        """A CPU profile (`fourd calibrate`): ranks share cores, and it describes what `fourd train` runs here."""
        return self.node.concurrent_ranks is not None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _find(name_or_path: str) -> Path:
    if name_or_path.endswith(".toml") or os.sep in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise FourdError(f"cluster {name_or_path}: no such file; give a preset name or a path to a .toml profile")
        return path
    for folder in (fourd_home() / "clusters", PRESET_DIR):
        path = folder / f"{name_or_path}.toml"
        if path.is_file():
            return path
    hint = " (run `fourd calibrate` to write it)" if name_or_path == "local" else ""
    raise FourdError(
        f"unknown cluster {name_or_path!r}{hint}: choose one of {', '.join(preset_names())}, "
        f"a profile in {fourd_home() / 'clusters'}, or a path to a .toml file"
    )


# Fields that must be above zero (the rest of the numbers: at least zero); each value of its declared type.
POSITIVE = {
    *("m", "n", "k", "tflops", "seq", "head_dim", "fwd_tflops", "bwd_tflops", "masked_fwd_tflops"),
    *("masked_bwd_tflops", "nproc", "beta_s_per_byte", "peak_tflops", "memory_gb", "hbm_bw_gbps", "sms"),
    *("gemm_efficiency", "attention_fwd_efficiency", "attention_bwd_efficiency", "elementwise_gbps"),
    *("optimizer_gbps", "gpus", "intra_bw_gbps", "intra_efficiency", "concurrent_ranks", "nic_bw_gbps"),
    *("nic_efficiency", "gpus_per_rack", "gpus_per_pod", "cross_pod_oversubscription"),
}
_TYPES = {"int": (int,), "float": (int, float), "str": (str,)}


def _section(cls, data, where: str, path: Path):
    """`cls` from a TOML table, every key known, every number finite and in range, of its field's type."""
    if not isinstance(data, dict):
        raise FourdError(f"{path}: [{where}] must be a table; see docs/planner.md for the schema")
    fields = cls.__dataclass_fields__
    bad = set(data) - set(fields)
    if bad:
        raise FourdError(
            f"{path}: unknown key(s) {', '.join(sorted(bad))} in [{where}]; allowed: {', '.join(sorted(fields))}"
        )
    for key, value in data.items():
        kind = _TYPES.get(str(fields[key].type).split(" ")[0])
        if kind is None:
            continue  # the tuples of samples, read by their own _section
        if isinstance(value, bool) or not isinstance(value, kind):
            raise FourdError(f"{path}: {where}.{key} = {value!r} must be of type {kind[-1].__name__}")
        if not isinstance(value, str) and not (math.isfinite(value) and (value > 0 if key in POSITIVE else value >= 0)):
            raise FourdError(
                f"{path}: {where}.{key} = {value} must be a finite number {'above' if key in POSITIVE else 'of at least'} 0"
            )
    try:
        return cls(**data)
    except TypeError as e:
        raise FourdError(f"{path}: [{where}] is incomplete ({e}); see docs/planner.md for the schema") from None


def load_cluster(name_or_path: str) -> Cluster:
    """The profile called `name_or_path` (user profiles first, then presets) or the profile at that path."""
    path = _find(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise FourdError(
            f"{path}: not a readable TOML profile ({e}); fix the file or rerun `fourd calibrate`"
        ) from None
    for key in ("gpu", "node", "network"):
        if not isinstance(data.get(key), dict):
            raise FourdError(f"{path}: missing the [{key}] table; see docs/planner.md for the schema")
    gpu = dict(data["gpu"])
    for key, cls in (("gemm", GemmSample), ("gemm_shapes", GemmSample), ("attention", AttentionSample)):
        gpu[key] = tuple(_section(cls, g, f"gpu.{key}", path) for g in gpu.get(key, ()))
    dtype = data.get("dtype", "bf16")
    if dtype not in DTYPE_BYTES:
        raise FourdError(f"{path}: dtype = {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    cluster = Cluster(
        name=str(data.get("name", path.stem)),
        description=str(data.get("description", "")),
        gpu=_section(GPU, gpu, "gpu", path),
        node=_section(Node, data["node"], "node", path),
        network=_section(Network, data["network"], "network", path),
        dtype=dtype,
        collectives=tuple(_section(CollectiveSample, c, "collectives", path) for c in data.get("collectives", ())),
        source=str(path),
    )
    return cluster


# ---- placement of a parallel group ------------------------------------------------------------------

LEVELS = ("single", "nvlink", "rack", "pod", "cross-pod")


@dataclass(frozen=True)
class Group:
    """Ranks base, base+stride, ..., base+(size-1)·stride of a world of `world` ranks, placed in rank order
    on the cluster (rank r on server r // gpus_per_node). Every rank belongs to one such group per dimension."""

    size: int
    stride: int
    world: int


def group_level(group: Group, cluster: Cluster) -> str:
    """The widest part of the topology the group's traffic crosses."""
    if group.size <= 1:
        return "single"
    span = (group.size - 1) * group.stride + 1
    net = cluster.network
    if span <= cluster.node.gpus and group.stride < cluster.node.gpus:
        return "nvlink"
    if span <= net.gpus_per_rack:
        return "rack"
    if span <= net.gpus_per_pod:
        return "pod"
    return "cross-pod"


def members_per_node(group: Group, cluster: Cluster) -> int:
    if group.stride >= cluster.node.gpus:
        return 1
    return max(1, min(group.size, cluster.node.gpus // group.stride))


def group_bandwidth(group: Group, cluster: Cluster) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, per-step latency in s) of a ring over the group.

    Inside a server the ring runs on NVLink. Across servers each of the k members per server drives its
    own NIC (one ring channel per NIC, as NCCL does), so the ring moves k·nic_bw, capped by NVLink. Groups
    that cross pods share the pod's uplinks: gpus_per_pod·nic_bw/oversubscription among all crossing channels.
    """
    node, net = cluster.node, cluster.network
    intra = node.intra_bw_gbps * 1e9 * node.intra_efficiency
    level = group_level(group, cluster)
    if level in ("single", "nvlink"):
        return intra, node.intra_latency_us * 1e-6
    k = members_per_node(group, cluster)
    nic = net.nic_bw_gbps * 1e9 * net.nic_efficiency
    if level == "cross-pod":
        per_pod_members = max(1, min(group.size, net.gpus_per_pod // group.stride))
        crossing_channels = min(group.world, net.gpus_per_pod) / per_pod_members * k
        uplink = net.gpus_per_pod * nic / net.cross_pod_oversubscription
        nic = min(nic, uplink / crossing_channels)
    return min(intra, k * nic), net.latency_us * 1e-6


def placement(layout) -> dict[str, Group]:
    """The group of each parallel dimension for ranks laid out innermost first in [TP, CP, PP, DP] order."""
    world = layout.world
    return {
        "tp": Group(layout.tp, 1, world),
        "cp": Group(layout.cp, layout.tp, world),
        "pp": Group(layout.pp, layout.tp * layout.cp, world),
        "dp": Group(layout.dp, layout.tp * layout.cp * layout.pp, world),
    }


def shard_group(layout, replicas: int = 1) -> Group:
    """The cp·dp ranks that hold the same weights (one TP and PP position): they reduce gradients together
    and ZeRO shards over them (FSDP over dp×cp, as the trainer and Llama 3 do), or over 1/`replicas` of them
    with HSDP. Modelled as one ring spread evenly over the span of the DP group (exact when cp or dp is 1)."""
    if layout.dp == 1:
        return Group(layout.cp, layout.tp, layout.world)
    return Group(layout.cp * layout.dp // replicas, layout.tp * layout.pp, layout.world)


def replica_group(layout, replicas: int) -> Group:
    """HSDP: the ranks holding the same shard in each of the `replicas` groups (outermost)."""
    return Group(replicas, layout.world // replicas, layout.world)
