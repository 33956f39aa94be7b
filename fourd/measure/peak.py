"""The peak FLOP/s and the peak memory of the device one worker runs on: the datasheet on a GPU, a
measured all-core matmul rate on CPUs (`fourd calibrate`'s profile when there is one)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
from pathlib import Path

from fourd.errors import FourdError
from fourd.measure.timing import gemm_tflops
from fourd.plan.cluster import load_cluster

# Dense BF16 peaks from the vendors' datasheets (TFLOP/s, without sparsity).
GPU_PEAK_TFLOPS = {
    "H100": 989,
    "H200": 989,
    "H800": 989,
    "A100": 312,
    "A800": 312,
    "L40S": 362,
    "A10G": 125,
    "L4": 121,
    "GB200": 2500,
    "B200": 2250,
}


def cpu_peak_flops(cache_dir: Path) -> tuple[float, str]:
    """The best all-core FP32 matmul rate of this machine and where it comes from. Measured once and
    kept (per CPU model and core count) only when the machine was quiet: on a busy one it reads low,
    and MFU high."""
    key = f"{platform.processor() or platform.machine()}-{os.cpu_count()}"
    path = cache_dir / "cpu_peak.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(path.read_text())
        if cached["key"] == key and cached["quiet"]:
            return float(
                cached["flops"]
            ), f"FP32 matmul measured on this machine when quiet, kept in {path}"
    cores = os.cpu_count() or 1
    flops = (
        max(gemm_tflops(count, threads=cores, seconds=0.2) for count in (512, 1024, 2048)) * 1e12
    )
    load = os.getloadavg()[0]
    if load > cores / 2:
        return flops, f"FP32 matmul measured now on a busy machine, load {load:.1f}: MFU reads high"
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "flops": flops, "quiet": True}))
    os.replace(tmp, path)
    return flops, "FP32 matmul measured now on this quiet machine"


def device_peak_flops(device_type: str, cache_dir: Path) -> tuple[float, str]:
    """(peak FLOP/s of the hardware one worker runs on, where the figure comes from)."""
    if device_type == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        tflops = next((value for k, value in GPU_PEAK_TFLOPS.items() if k in name), None)
        if tflops is None:
            return 989e12, f"{name} unknown: H100's 989 TFLOP/s assumed"
        return tflops * 1e12, f"{name} datasheet, dense BF16"
    try:  # `fourd calibrate` measures the all-core rate more carefully than the quick benchmark
        return load_cluster(
            "local"
        ).gpu.peak_tflops * 1e12, "the `fourd calibrate` profile of this machine"
    except FourdError:
        return cpu_peak_flops(cache_dir)


def peak_memory_gb(device_type: str) -> float:
    if device_type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
