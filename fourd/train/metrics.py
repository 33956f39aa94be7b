"""Per-step metrics: MFU against the device's peak, memory, and where they are written
(metrics.jsonl, TensorBoard, a progress bar or plain lines, and a closing summary)."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

# Dense BF16 peaks from the vendors' datasheets (TFLOP/s, without sparsity).
GPU_PEAK_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "B200": 2250.0,
    "GB200": 2500.0,
}


def measure_cpu_peak_flops(seconds: float = 1.0) -> float:
    """Best FP32 matmul throughput of this machine with all cores (FLOP/s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        best = 0.0
        for n in (512, 1024, 2048, 1024, 2048):  # repeats: the best of several is the least disturbed
            a, b = torch.randn(n, n), torch.randn(n, n)
            a @ b
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 5 or reps < 2:
                a @ b
                reps += 1
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(threads)


def cpu_peak_flops(cache_dir: Path) -> float:
    """The machine's measured peak, measured once (on a machine not busy with other work) and cached per
    CPU model and core count."""
    key = f"{platform.processor() or platform.machine()}-{os.cpu_count()}"
    path = cache_dir / "cpu_peak.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return float(cached["flops"])
    except (OSError, ValueError, KeyError):
        pass
    flops = measure_cpu_peak_flops()
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        return flops  # other work shares the cores: good for this run, too low to keep
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "flops": flops}))
    os.replace(tmp, path)
    return flops


def device_peak_flops(device_type: str, cache_dir: Path) -> tuple[float, str]:
    """(peak FLOP/s of the hardware one worker runs on, where the figure comes from)."""
    if device_type == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name} datasheet dense BF16"
        return 989e12, f"{name} (unknown: assuming H100's 989 TFLOP/s)"
    from fourd.errors import FourdError
    from fourd.plan.cluster import load_cluster

    try:  # `fourd calibrate` measures the all-core rate more carefully than the quick benchmark below
        return load_cluster("local").gpu.peak_tflops * 1e12, "`fourd calibrate` profile (local)"
    except FourdError:
        return cpu_peak_flops(cache_dir), "measured FP32 matmul, all cores (run `fourd calibrate` to refine)"


def peak_memory_gb(device_type: str) -> float:
    if device_type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsWriter:
    """Rank 0's outputs. metrics.jsonl is flushed every step so a crash loses nothing already logged."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, tensorboard: bool = True):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._trim(start_step)
        self.file = open(self.path, "a")
        self.rows: list[dict] = []
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                self.tb = None
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _trim(self, start_step: int) -> None:
        """A resumed run rewrites the steps after its checkpoint: keep the rows before it only."""
        if not self.path.exists():
            return
        keep = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= start_step
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def log(self, row: dict, show: bool) -> None:
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])
        text = (
            f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  grad {row['grad_norm']:.3f}  "
            f"{row['tokens_per_s']:,.0f} tok/s  mfu {100 * row['mfu']:.1f}%"
        )
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif show:
            print(f"step {row['step']:>5}  {text}  {row['step_time_s']:.3f} s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.file.close()


def summary_table(rows: list[dict], extra: dict[str, str], predicted: dict | None = None) -> str:
    """The closing summary; `predicted` (fourd.train.auto.predict) puts the planner's figures beside the measured."""
    if not rows:
        return "no steps run"
    timed = rows[1:] or rows  # the first step pays for warm-up
    mean = lambda k: sum(r[k] for r in timed) / len(timed)
    got = {k: mean(k) for k in ("tokens_per_s", "step_time_s", "mfu")} | {
        "peak_mem_gb": max(r["peak_mem_gb"] for r in rows)
    }

    def beside(key: str, form: str) -> str:
        if not predicted:
            return ""
        return f"; planner {form.format(predicted[key])} ({(predicted[key] - got[key]) / got[key]:+.0%})"

    items = [
        ("steps", f"{rows[0]['step']} .. {rows[-1]['step']}"),
        ("loss", f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} (min {min(r['loss'] for r in rows):.4f})"),
        ("tokens/s", f"{got['tokens_per_s']:,.0f} (mean after the first step)" + beside("tokens_per_s", "{:,.0f}")),
        ("step time", f"{got['step_time_s']:.3f} s" + beside("step_time_s", "{:.3f} s")),
        ("MFU", f"{100 * got['mfu']:.2f} %" + beside("mfu", "{:.2%}")),
        ("peak memory", f"{got['peak_mem_gb']:.2f} GB per rank" + beside("peak_mem_gb", "{:.2f} GB")),
    ]
    if "bubble_fraction" in rows[-1]:
        items.append(("pipeline bubble", f"{100 * mean('bubble_fraction'):.1f} % (measured)"))
    items += list(extra.items())
    width = max(len(k) for k, _ in items)
    line = "-" * (width + 3 + max(len(v) for _, v in items))
    return "\n".join([line] + [f"{k:<{width}}   {v}" for k, v in items] + [line])
