"""`anchor.json`: a run's own measured step, in the form `fourd plan --anchor` reads (fourd.plan.anchor),
written by rank 0 at the end of every `fourd train` run beside metrics.jsonl."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from fourd.config import Config, model_config, parallelism

NAME = "anchor.json"
WARMUP = (
    3  # steps dropped before the median (start-up, allocator and thread-pool warm-up); one is kept
)


def _cluster(device_type: str) -> str:
    """The profile of this machine: `local` on CPU (`fourd calibrate` writes it), else the GPU's preset."""
    if device_type != "cuda":
        return "local"
    import torch

    from fourd.train.auto import gpu_preset

    return gpu_preset(torch.cuda.get_device_name())


def anchor_record(cfg: Config, rows: list[dict], device_type: str) -> dict:
    """The anchor of a run: the median step time after WARMUP steps (at least one step kept), the peak
    memory of the fullest step in GB (10^9 bytes; rank 0's), and the settings it ran with."""
    par, seq = parallelism(cfg), cfg.data.seq_len
    timed = rows[min(WARMUP, len(rows) - 1) :]
    peak_gib = max(r["peak_mem_gb"] for r in rows)  # fourd.measure.peak reports GiB
    lay = par.layout
    return {
        "model": model_config(cfg).to_dict(),
        "cluster": _cluster(device_type),
        "gpus": lay.world,
        "layout": f"tp={lay.tp},cp={lay.cp},pp={lay.pp},dp={lay.dp}",
        "schedule": par.schedule,
        "virtual_stages": par.virtual_stages,
        "microbatches": par.microbatches,
        "seq": seq,
        "global_batch_tokens": cfg.train.global_batch * seq,
        "recompute": par.recompute,
        "zero": par.zero,
        "sequence_parallel": par.sequence_parallel,
        "hsdp_replicas": par.hsdp_replicas,
        "dtype": "fp32" if device_type != "cuda" else "bf16",
        "compiled": bool(cfg.train.compile) if device_type == "cuda" else False,
        "stack": "fourd",
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_memory_gb": peak_gib * 2**30 / 1e9,
        "steps_timed": len(timed),
    }


def write_anchor(run_dir: Path | str, cfg: Config, rows: list[dict], device_type: str) -> None:
    """Write run_dir/anchor.json (whole or not at all: a temporary file renamed into place)."""
    if not rows:
        return
    path = Path(run_dir) / NAME
    part = path.with_suffix(".json.part")
    part.write_text(json.dumps(anchor_record(cfg, rows, device_type), indent=1) + "\n")
    part.replace(path)
