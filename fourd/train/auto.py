"""The planner inside `fourd train`: `--layout auto`, the memory check before every launch, and the prediction the
closing summary puts beside the measurement (docs/parallelism.md)."""

from __future__ import annotations

import os
from dataclasses import replace

from fourd.config import Config, fourd_home, model_config, parallelism
from fourd.errors import FourdError, plural
from fourd.layout import Parallelism
from fourd.measure.peak import device_peak_flops
from fourd.plan.cluster import GPU, Cluster, Network, Node, load_cluster
from fourd.plan.job import Job
from fourd.plan.request import best_plan, rank_peak_memory_gb
from fourd.plan.search import evaluate

GPU_PRESETS = {
    "H200": "dgx-h200",
    "H100": "dgx-h100",
    "A100": "selene-a100",
}  # the first name found wins


def use_cuda(cfg: Config) -> bool:
    import torch

    return torch.cuda.is_available() and cfg.train.dtype != "fp32"


def machine(cfg: Config):
    """(this machine's cluster profile, its devices, the bytes one device holds: on CPU, RAM shared by all ranks)."""
    import torch

    if use_cuda(cfg):
        name = torch.cuda.get_device_name()
        preset = next((p for key, p in GPU_PRESETS.items() if key in name), "dgx-h100")
        return (
            load_cluster(preset),
            torch.cuda.device_count(),
            torch.cuda.get_device_properties(0).total_memory,
        )
    with open("/proc/meminfo") as f:
        ram = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    cores = os.cpu_count() or 1
    try:
        cluster = load_cluster("local")
    except (
        FourdError
    ):  # not calibrated: the measured matmul peak, and the planner's rates for the rest
        peak_tflops = device_peak_flops("cpu", fourd_home())[0] / 1e12
        gpu = GPU("CPU worker (estimate; `fourd calibrate` measures)", peak_tflops, ram / 1e9, 10.0)
        cluster = Cluster(
            "cpu",
            "this machine",
            gpu,
            Node(cores, 1.0, concurrent_ranks=cores),
            Network(1.0),
            "fp32",
        )
    return cluster, cores, ram


def choose(cfg: Config, cluster, devices: int) -> None:
    """Set cfg.parallel to the planner's fastest plan that fits `devices` devices, and say what it chose."""
    c, step_s = _best(cfg, cluster, devices)
    for key in (
        "schedule",
        "microbatches",
        "virtual_stages",
        "zero",
        "recompute",
        "sequence_parallel",
    ):
        setattr(cfg.parallel, key, getattr(c, key))
    cfg.parallel.layout, cfg.parallel.hsdp_replicas = str(c.layout), c.hsdp_replicas
    print(
        f"fourd train: --layout auto on {cluster.name} ({devices} devices): {c.layout}, {c.schedule}, "
        f"{plural(c.microbatches, 'microbatch')}, ZeRO {c.zero}, recompute {c.recompute} (predicted {step_s:.3g} s/step)",
        flush=True,
    )


def _best(cfg: Config, cluster, devices: int) -> tuple[Parallelism, float]:
    plan = best_plan(model_config(cfg), cluster, devices, cfg.data.seq_len, cfg.train.global_batch)
    return plan.config, plan.step.step_s


def check_memory(cfg: Config, cluster, capacity: int) -> None:
    """FourdError naming a fix when the planner's peak memory of a rank (times the ranks on a CPU) does not fit."""
    par = parallelism(cfg)
    ranks = par.layout.world if cluster.cpu else 1
    need = _need(cfg, cluster, par) * ranks
    if need > capacity:
        where = f"{capacity / 1e9:.1f} GB {'of RAM available' if cluster.cpu else 'per GPU'}"
        raise FourdError(
            f"memory: {cfg.model.preset} at layout {par.layout} needs about {need / 1e9:.1f} GB"
            f"{f' for its {ranks} ranks' if ranks > 1 else ''}, more than {where}: {_fix(cfg, cluster, par, capacity / ranks)}"
        )


def _need(cfg: Config, cluster, par: Parallelism, global_seqs: int = 0) -> float:
    seqs = global_seqs or cfg.train.global_batch
    return rank_peak_memory_gb(model_config(cfg), cluster, par, cfg.data.seq_len, seqs) * 1e9


def _fix(cfg: Config, cluster, par: Parallelism, capacity: float) -> str:
    """The first change that fits: full recomputation, the smallest global batch, the planner's layout."""
    if par.recompute != "full" and _need(cfg, cluster, replace(par, recompute="full")) <= capacity:
        return "recompute each layer in backward (--parallel.recompute=full)"
    smallest = par.layout.dp * par.microbatches
    if smallest < cfg.train.global_batch and _need(cfg, cluster, par, smallest) <= capacity:
        return f"train on a smaller global batch (--train.global_batch={smallest})"
    best, _ = _best(cfg, cluster, par.layout.world)
    if _need(cfg, cluster, best) <= capacity:
        return f"use the planner's layout (--layout auto: {best.layout}, ZeRO {best.zero}, recompute {best.recompute})"
    return f"no layout of {plural(par.layout.world, 'device')} fits: train a smaller model, or on more devices"


def predict(cfg: Config, peak_flops: float, world: int, device_type: str) -> dict:
    """The planner's step time, tokens/s, MFU (the trainer's definition) and peak memory of rank 0 (GiB) for this run."""
    from fourd.parallel.apply import compiles

    cluster, _, _ = machine(cfg)
    mcfg, seq, seqs = model_config(cfg), cfg.data.seq_len, cfg.train.global_batch
    plan = evaluate(
        Job(mcfg, cluster, parallelism(cfg), seq, seqs, compiled=compiles(cfg, device_type))
    )
    step = plan.step.step_s
    mfu = (
        mcfg.flops_per_token(seq)
        * seqs
        * seq
        / step
        / (peak_flops * (world if device_type == "cuda" else 1))
    )
    memory = {"peak_mem_gb": (plan.memory.total + plan.memory.reserve) / 2**30}
    return {"step_time_s": step, "tokens_per_s": seqs * seq / step, "mfu": mfu} | memory
