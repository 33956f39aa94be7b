"""A cluster's network fitted to nccl-tests: the two figures of a profile's [network] table that a
datasheet does not give, the latency of one step of a collective between servers (`latency_us`) and
the fraction of the NIC's rate a collective reaches (`nic_efficiency`), chosen so that the planner's
own collective model (`fourd.plan.kernels.collective_time`) reproduces measured all-reduces,
all-gathers and reduce-scatters across servers (`fourd calibrate --nccl-tests`; docs/planner.md,
"A cluster's network from nccl-tests").

Input: nccl-tests' own output (`all_reduce_perf` and friends; the ranks and their hosts from its
"#  Rank" lines, the collective from a "Collective test starting" line or the file name), or a CSV
with the columns op,nodes,ranks,bytes,time_us (lines starting with # are comments)."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from fourd.errors import FourdError
from fourd.plan.cluster import Cluster, Group
from fourd.plan.kernels import collective_time

OPS = ("all_reduce", "all_gather", "reduce_scatter")
# nccl-tests' other collectives: their runs are left out of a fit, and counted as such
OTHER_NCCL_TESTS = ("alltoall", "broadcast", "reduce", "sendrecv", "gather", "scatter", "hypercube")
# Below this a collective runs NCCL's low-latency protocols, whose latencies the planner's
# Simple-protocol steps do not describe; training's buckets and layers move more.
SMALLEST_MESSAGE = 1 << 20
CSV_COLUMNS = ("op", "nodes", "ranks", "bytes", "time_us")
# nccl-tests' lines naming a rank's host, and the collective a run measures
RANK_LINE = re.compile(r"#\s+Rank\s+\d+\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)")
STARTING_LINE = re.compile(r"Collective test starting:\s*(\w+?)(_perf)?\b")
# The fit's search: network step latencies in microseconds and NIC efficiencies, coarse then fine.
COARSE_LATENCIES_US = range(0, 501, 10)
COARSE_EFFICIENCIES = [step / 20 for step in range(1, 21)]
FINE_LATENCY_STEP_US = 1
FINE_EFFICIENCY_STEP = 0.01


@dataclass(frozen=True)
class NcclSample:
    """One measured collective: its op, the servers and ranks it ran on, its buffer in nccl-tests'
    bytes (an all-gather's output, a reduce-scatter's input) and its out-of-place time."""

    op: str
    nodes: int
    ranks: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class NetworkFit:
    """The fitted network step latency and NIC efficiency, the samples, and the model's error on
    each with the fit and with the base profile's own network."""

    latency_us: float
    nic_efficiency: float
    samples: tuple[NcclSample, ...]
    errors: tuple[float, ...]  # the fitted model's time over each sample's, minus one
    errors_before: tuple[float, ...]  # the same with the base profile's network

    @property
    def mean_error(self) -> float:
        return sum(abs(error) for error in self.errors) / len(self.errors)

    @property
    def mean_error_before(self) -> float:
        return sum(abs(error) for error in self.errors_before) / len(self.errors_before)


class Samples(NamedTuple):
    """A file's samples that a fit uses, and how many rows it left out for each reason."""

    kept: list[NcclSample]
    left_out: dict[str, int]


def read_samples(path: Path) -> Samples:
    """The samples of one file, nccl-tests output or CSV (module docstring), that say something of
    the network: collectives the planner models, across servers, of 1 MiB or more."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise FourdError(
            f"--nccl-tests {path}: cannot read it ({error}); give a readable file"
        ) from None
    lines = [line for line in text.splitlines() if line.strip()]
    header = next((line for line in lines if not line.startswith("#")), "")
    if header.replace(" ", "").startswith(",".join(CSV_COLUMNS)):
        samples = _csv_samples(text, path)
    else:
        samples = _nccl_tests_samples(lines, path)
    kept: list[NcclSample] = []
    left_out: dict[str, int] = {}
    for sample in samples:
        reason = _left_out_because(sample)
        if reason:
            left_out[reason] = left_out.get(reason, 0) + 1
        else:
            kept.append(sample)
    return Samples(kept, left_out)


def _left_out_because(sample: NcclSample) -> str:
    """Why a sample says nothing of the network the planner models ("" when it does)."""
    if sample.op not in OPS:
        return f"of {sample.op} (not modelled)"
    if sample.nodes == 1:
        return "on one server"
    if sample.nbytes < SMALLEST_MESSAGE:
        return "under 1 MiB"
    return ""


def _csv_samples(text: str, path: Path) -> list[NcclSample]:
    rows = csv.DictReader(
        io.StringIO(
            "\n".join(
                line for line in text.splitlines() if line.strip() and not line.startswith("#")
            )
        )
    )
    samples = []
    for number, row in enumerate(rows, start=2):
        try:
            sample = NcclSample(
                op=row["op"].strip(),
                nodes=int(row["nodes"]),
                ranks=int(row["ranks"]),
                nbytes=int(row["bytes"]),
                seconds=float(row["time_us"]) * 1e-6,
            )
        except (TypeError, ValueError):
            raise FourdError(
                f"--nccl-tests {path}: row {number} is not op,nodes,ranks,bytes,time_us with "
                "whole numbers and a time in microseconds; fix that row"
            ) from None
        if sample.op not in OPS:  # a misspelt op would otherwise be left out unseen
            raise FourdError(
                f"--nccl-tests {path}: collective {sample.op!r} is not one the planner models; "
                f"give {', '.join(OPS)}"
            )
        samples.append(_checked(sample, path))
    return samples


def _nccl_tests_samples(lines: list[str], path: Path) -> list[NcclSample]:
    """The rows of every run in an nccl-tests log, one file or several runs concatenated: each run
    opens with its "# nThread" line, lists its ranks and their hosts, then one row a size (the
    out-of-place time in microseconds is the sixth field); its collective is named by a "Collective
    test starting" line before it or, failing that, by the file's name."""
    if not any(RANK_LINE.match(line) for line in lines):
        raise FourdError(
            f"--nccl-tests {path}: neither nccl-tests output (no '#  Rank N ... on HOST' lines) "
            f"nor a CSV with the header {','.join(CSV_COLUMNS)}; give one of those"
        )
    op = ""
    hosts: list[str] = []  # the current run's rank lines' hosts, one a rank
    samples: list[NcclSample] = []
    for line in lines:
        if starting := STARTING_LINE.search(line):
            op = _nccl_tests_op(starting.group(1), path)
            continue
        if line.startswith("# nThread"):
            hosts = []
            continue
        if rank := RANK_LINE.match(line):
            hosts.append(rank.group(1))
            continue
        fields = line.split()
        if line.startswith("#") or len(fields) < 9 or not fields[0].isdigit() or not hosts:
            continue
        try:
            seconds = float(fields[5]) * 1e-6
        except ValueError:
            continue
        sample = NcclSample(
            op or _op_of_name(path), len(set(hosts)), len(hosts), int(fields[0]), seconds
        )
        samples.append(_checked(sample, path))
    return samples


def _nccl_tests_op(name: str, path: Path) -> str:
    if name not in OPS + OTHER_NCCL_TESTS:
        raise FourdError(
            f"--nccl-tests {path}: {name!r} is not an nccl-tests collective; give the output of "
            f"{', '.join(f'{op}_perf' for op in OPS)}"
        )
    return name


def _op_of_name(path: Path) -> str:
    """The collective a log's file name names (nccl-tests' binaries: all_reduce_perf, ...), the
    modelled ones first: all_reduce_perf also contains "reduce"."""
    stem = path.name.split(".")[0]
    for op in OPS + OTHER_NCCL_TESTS:
        if op in stem:
            return op
    raise FourdError(
        f"--nccl-tests {path}: cannot tell which collective it measured; name the file after it "
        f"(one of {', '.join(OPS)}, e.g. all_reduce_perf.log)"
    )


def _checked(sample: NcclSample, path: Path) -> NcclSample:
    """The sample, or one line naming what is wrong with its nodes, ranks, size or time."""
    if sample.nodes < 1 or sample.ranks < sample.nodes or sample.ranks % sample.nodes:
        raise FourdError(
            f"--nccl-tests {path}: {sample.ranks} ranks on {sample.nodes} nodes are not the same "
            "number on every node; give whole nodes"
        )
    if sample.nbytes <= 0 or not (math.isfinite(sample.seconds) and sample.seconds > 0):
        raise FourdError(
            f"--nccl-tests {path}: a {sample.op} of {sample.nbytes} bytes in {sample.seconds * 1e6} "
            "us; sizes and times must be above 0"
        )
    return sample


def _with_network(cluster: Cluster, latency_us: float, nic_efficiency: float) -> Cluster:
    network = dataclasses.replace(
        cluster.network, latency_us=latency_us, nic_efficiency=nic_efficiency
    )
    return dataclasses.replace(cluster, network=network)


def _errors(samples: list[NcclSample], cluster: Cluster) -> list[float]:
    """The planner's time of each sample on `cluster` over the measured one, minus one."""
    return [
        collective_time(sample.op, sample.nbytes, Group(sample.ranks, 1, sample.ranks), cluster)
        / sample.seconds
        - 1
        for sample in samples
    ]


def _loss(samples: list[NcclSample], cluster: Cluster) -> float:
    """The mean squared log ratio of predicted to measured times: a factor of two too slow weighs
    what a factor of two too fast does."""
    return sum(math.log1p(error) ** 2 for error in _errors(samples, cluster)) / len(samples)


def fit_network(samples: list[NcclSample], cluster: Cluster) -> NetworkFit:
    """The network step latency and NIC efficiency under which `cluster`'s collective model best
    reproduces `samples` (least squares of the log time ratio, searched on a grid of 10 us and 0.05,
    then of 1 us and 0.01 around the best); every other figure of the profile stays."""
    if not samples:
        raise FourdError(
            "--nccl-tests: no collective across servers of 1 MiB or more in the files; run "
            "nccl-tests on two or more nodes (e.g. all_reduce_perf -b 1M -e 8G -f 2)"
        )
    for sample in samples:
        if sample.ranks // sample.nodes != cluster.node.gpus:
            raise FourdError(
                f"--nccl-tests: {sample.ranks} ranks on {sample.nodes} nodes run "
                f"{sample.ranks // sample.nodes} a node, and {cluster.name} has "
                f"{cluster.node.gpus} GPUs a node; give --cluster a profile with "
                f"{sample.ranks // sample.nodes}"
            )

    def best(latencies, efficiencies) -> tuple[float, float, float]:
        return min(
            (_loss(samples, _with_network(cluster, latency, efficiency)), latency, efficiency)
            for latency in latencies
            for efficiency in efficiencies
        )

    _, latency, efficiency = best(COARSE_LATENCIES_US, COARSE_EFFICIENCIES)
    fine_latencies = [
        latency + FINE_LATENCY_STEP_US * step
        for step in range(-10, 11)
        if latency + FINE_LATENCY_STEP_US * step >= 0
    ]
    fine_efficiencies = [
        round(efficiency + FINE_EFFICIENCY_STEP * step, 2)
        for step in range(-5, 6)
        if 0 < efficiency + FINE_EFFICIENCY_STEP * step <= 1
    ]
    _, latency, efficiency = best(fine_latencies, fine_efficiencies)
    return NetworkFit(
        latency_us=latency,
        nic_efficiency=efficiency,
        samples=tuple(samples),
        errors=tuple(_errors(samples, _with_network(cluster, latency, efficiency))),
        errors_before=tuple(_errors(samples, cluster)),
    )


def profile_with_network(base_text: str, fit: NetworkFit, name: str, command: str) -> str:
    """The base profile's TOML named `name`, its [network] table's latency_us and nic_efficiency set
    to the fit's (added where the table lacks them), every other line kept, and a header saying
    so."""
    lines = base_text.splitlines()
    first_table = next(
        (index for index, line in enumerate(lines) if line.lstrip().startswith("[")), len(lines)
    )
    lines = [
        f'name = "{name}"' if index < first_table and re.match(r"name\s*=", line) else line
        for index, line in enumerate(lines)
    ]
    start = next(
        (index for index, line in enumerate(lines) if line.strip().startswith("[network]")), None
    )
    if start is None:
        raise FourdError("--cluster: the base profile has no [network] table; give a full profile")
    end = next(
        (index for index in range(start + 1, len(lines)) if lines[index].lstrip().startswith("[")),
        len(lines),
    )
    values = {
        "latency_us": f"latency_us = {fit.latency_us:g}             # fitted: `{command}`",
        "nic_efficiency": f"nic_efficiency = {fit.nic_efficiency:g}         # fitted, as above",
    }
    table = [line for line in lines[start + 1 : end] if line.split("=")[0].strip() not in values]
    while table and not table[-1].strip():
        table.pop()
    header = [
        f"# The network below was fitted to nccl-tests by `{command}`: {len(fit.samples)} "
        f"collectives, mean error {fit.mean_error:.1%} (the base profile's: "
        f"{fit.mean_error_before:.1%}).",
    ]
    return (
        "\n".join(
            header + lines[: start + 1] + table + list(values.values()) + [""] + lines[end:]
        ).rstrip("\n")
        + "\n"
    )
