"""The planner inside `fourd train`: `--layout auto`, the memory check before every launch, and the
prediction the closing summary puts beside the measurement (docs/parallelism.md)."""

from __future__ import annotations

import os
import resource
from dataclasses import replace

from fourd.config import Config, fourd_home, model_config, parallelism
from fourd.errors import FourdError, plural
from fourd.layout import Parallelism
from fourd.measure.calibrate import CPU_DEVICES
from fourd.measure.peak import device_peak_flops
from fourd.plan.cluster import GPU, Cluster, GemmSample, Network, Node, load_cluster
from fourd.plan.job import Job
from fourd.plan.memory import rank_memories
from fourd.plan.request import best_plan, rank_peak_memory_gb
from fourd.plan.search import evaluate
from fourd.train.metrics import mfu_peak

GPU_PRESETS = {
    "GB200": "dgx-gb200",
    "B200": "dgx-b200",  # after GB200, whose name holds "B200"
    "H200": "dgx-h200",
    "H100": "dgx-h100",
    "H800": "hgx-h800",  # the export parts: an H100's and an A100's compute with NVLink at 400 GB/s
    "A100": "selene-a100",
    "A800": "dgx-a800",
}  # the first name found wins


def gpu_preset(device_name: str) -> str:
    """The cluster preset of a GPU by the name CUDA reports for it (torch.cuda.get_device_name: "NVIDIA
    H100 80GB HBM3", "NVIDIA GB200"), the first key of GPU_PRESETS the name holds; a GPU none names
    plans as an H100's (dgx-h100)."""
    return next((preset for key, preset in GPU_PRESETS.items() if key in device_name), "dgx-h100")


# the name of the CPU profile built when `fourd calibrate` has not run, and the summary's line
# about it
UNCALIBRATED = "uncalibrated"
NOT_CALIBRATED = (
    "no time figures before `fourd calibrate` (a minute) has measured this machine's "
    "CPU time per layer"
)


def use_cuda(cfg: Config) -> bool:
    import torch

    return torch.cuda.is_available() and cfg.train.dtype != "fp32"


def machine(cfg: Config, baseline_bytes: float | None = None):
    """(this machine's cluster profile, its devices, the bytes one device holds: on CPUs the RAM all
    ranks share). On CPUs the profile's runtime reserve is `baseline_bytes` a rank (default: this
    process's resident memory now): what the interpreter, torch, the data and the process group hold
    before the model."""
    import torch

    if use_cuda(cfg):
        return (
            load_cluster(gpu_preset(torch.cuda.get_device_name())),
            torch.cuda.device_count(),
            torch.cuda.get_device_properties(0).total_memory,
        )
    with open("/proc/meminfo") as f:
        ram = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    cores = os.cpu_count() or 1
    try:
        cluster = load_cluster("local")
    except FourdError:
        cluster = _uncalibrated(ram, cores)
    if baseline_bytes is None:
        baseline_bytes = resident_bytes()
    gpu = replace(cluster.gpu, memory_reserve_gb=baseline_bytes / 1e9)
    return replace(cluster, gpu=gpu), cores, ram


def calibrated(cluster: Cluster) -> bool:
    """Whether the profile's time model rests on measurements of this machine (or a GPU's
    datasheet)."""
    return cluster.name != UNCALIBRATED


def _uncalibrated(ram: float, cores: int) -> Cluster:
    """A CPU profile from the measured all-core matmul peak alone, for `--layout auto` and the
    memory check. A worker is one single-threaded process: alone it multiplies at one core's share
    of the peak (peak / cores), and `concurrent_ranks` = cores makes ranks beyond the cores take
    turns, all on one server of at least `CPU_DEVICES` ranks, as `fourd calibrate` writes it. What
    it leaves out, the CPU time TP and FSDP add to each layer and gloo's collectives
    (docs/planner.md), is most of a multi-rank step on CPUs: the closing summary shows no
    predicted time from it."""
    peak_tflops = device_peak_flops("cpu", fourd_home())[0] / 1e12
    one_core = GemmSample(m=1024, n=1024, k=1024, tflops=peak_tflops / cores)
    gpu = GPU(
        name="CPU worker (estimate; `fourd calibrate` measures)",
        peak_tflops=peak_tflops,
        memory_gb=ram / 1e9,
        hbm_bw_gbps=10.0,
        gemm=(one_core,),
    )
    node = Node(gpus=max(CPU_DEVICES, cores), intra_bw_gbps=1.0, concurrent_ranks=cores)
    return Cluster(
        name=UNCALIBRATED,
        description="this machine",
        gpu=gpu,
        node=node,
        network=Network(nic_bw_gbps=1.0),
        dtype="fp32",
    )


def resident_bytes() -> float:
    """This process's resident memory now (Linux /proc/self/statm; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def choose(cfg: Config, cluster, devices: int) -> None:
    """Set cfg.parallel to the planner's fastest plan that fits `devices` devices, and say what it
    chose."""
    chosen, step_s = _best(cfg, cluster, devices)
    kept = ("schedule", "microbatches", "virtual_stages", "zero", "recompute", "sequence_parallel")
    for key in kept:
        setattr(cfg.parallel, key, getattr(chosen, key))
    cfg.parallel.layout = str(chosen.layout)
    cfg.parallel.hsdp_replicas = chosen.hsdp_replicas
    microbatches = plural(chosen.microbatches, "microbatch")
    print(
        f"fourd train: --layout auto on {cluster.name} ({devices} devices): {chosen.layout}, "
        f"{chosen.schedule}, {microbatches}, ZeRO {chosen.zero}, recompute {chosen.recompute} "
        f"(predicted {step_s:.3g} s/step)",
        flush=True,
    )


def _best(cfg: Config, cluster, devices: int) -> tuple[Parallelism, float]:
    plan = best_plan(model_config(cfg), cluster, devices, cfg.data.seq_len, cfg.train.global_batch)
    return plan.config, plan.step.step_s


def check_memory(cfg: Config, cluster, capacity: int) -> None:
    """FourdError naming a fix when the planner's peak memory of a rank (times the ranks on a CPU)
    does not fit."""
    par = parallelism(cfg)
    if cluster.cpu:  # the ranks share the machine's RAM
        ranks, where = par.layout.world, f"{capacity / 1e9:.1f} GB of RAM available"
    else:
        ranks, where = 1, f"{capacity / 1e9:.1f} GB per GPU"
    need = _need(cfg, cluster, par) * ranks
    if need > capacity:
        their = f" for its {ranks} ranks" if ranks > 1 else ""
        fix = _fix(cfg, cluster, par, capacity / ranks)
        raise FourdError(
            f"memory: {cfg.model.preset} at layout {par.layout} needs about {need / 1e9:.1f} GB"
            f"{their}, more than {where}: {fix}"
        )


def _need(cfg: Config, cluster, par: Parallelism, global_seqs: int = 0) -> float:
    seqs = global_seqs or cfg.train.global_batch
    return rank_peak_memory_gb(model_config(cfg), cluster, par, cfg.data.seq_len, seqs) * 1e9


def _fix(cfg: Config, cluster, par: Parallelism, capacity: float) -> str:
    """The first change that fits: full recomputation, the smallest global batch, the planner's
    layout."""
    if par.recompute != "full" and _need(cfg, cluster, replace(par, recompute="full")) <= capacity:
        return "recompute each layer in backward (--parallel.recompute=full)"
    smallest = par.layout.dp * par.microbatches
    if smallest < cfg.train.global_batch and _need(cfg, cluster, par, smallest) <= capacity:
        return f"train on a smaller global batch (--train.global_batch={smallest})"
    best, _ = _best(cfg, cluster, par.layout.world)
    if _need(cfg, cluster, best) <= capacity:
        return (
            f"use the planner's layout (--layout auto: {best.layout}, ZeRO {best.zero}, "
            f"recompute {best.recompute})"
        )
    devices = plural(par.layout.world, "device")
    return f"no layout of {devices} fits: train a smaller model, or on more devices"


def predict(
    cfg: Config, peak_flops: float, world: int, device_type: str, baseline_bytes: float
) -> dict:
    """The planner's step time, tokens/s, MFU (the trainer's definition) and peak memory of rank 0
    (GiB) for this run; on a CPU without a `fourd calibrate` profile only the memory, and "note":
    why not the rest."""
    from fourd.parallel.apply import compiles

    cluster, _, _ = machine(cfg, baseline_bytes)
    mcfg, seq, seqs = model_config(cfg), cfg.data.seq_len, cfg.train.global_batch
    job = Job(mcfg, cluster, parallelism(cfg), seq, seqs, compiled=compiles(cfg, device_type))
    plan = evaluate(job)
    rank0 = rank_memories(job, [0])[0]
    memory = {"peak_mem_gb": (rank0.total + rank0.reserve) / 2**30}
    if not calibrated(cluster):
        return memory | {"note": NOT_CALIBRATED}
    step = plan.step.step_s
    mfu = mcfg.flops_per_token(seq) * seqs * seq / step / mfu_peak(peak_flops, world, device_type)
    return {"step_time_s": step, "tokens_per_s": seqs * seq / step, "mfu": mfu} | memory
