"""One training worker: build the model, apply the layout's parallelism from outside, run the loop.

Parallelism is applied in the order of the mesh: pipeline split → TP → CP → DP (FSDP over dp×cp).
Every rank sees the same global batch of the same step (the data order depends on the seed only), so
any layout reproduces the single-process run up to floating-point rounding.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fourd.ckpt.dcp_io import Checkpointer
from fourd.config import Config, model_config
from fourd.data.dataset import SampleStream, TokenCache
from fourd.errors import FourdError
from fourd.parallel.apply import Parallel, build_parallel
from fourd.train.heartbeat import Heartbeat
from fourd.train.metrics import MetricsWriter, peak_memory_gb, summary_table
from fourd.train.step import build_optimizer, lr_at, train_step


def run_worker(cfg: Config, cache: TokenCache, peak_flops: float, peak_source: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    use_cuda = torch.cuda.is_available() and cfg.train.dtype != "fp32"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    timeout = timedelta(seconds=cfg.train.timeout_s)
    # The elastic agent keeps one TCP store for all restarts of the job: without a key prefix per
    # attempt, a restarted worker would read its peers' addresses from the failed attempt and hang.
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        store=dist.PrefixStore(f"fourd/attempt{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        **({"device_id": device} if use_cuda else {}),
    )
    # The digest gathers 2-D-sharded parameters once per checkpoint; DTensor's advice on merging those
    # all-gathers is about throughput, not correctness, and would flood every rank's log.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    beats = Heartbeat(rank, world, attempt)
    try:
        _train(cfg, cache, peak_flops, peak_source, rank, world, attempt, device, beats)
    except FourdError:
        raise
    except Exception as e:
        # A collective that timed out or lost a peer: say which rank did not keep up, and at which step.
        print(f"fourd: error: rank {rank}: {beats.report(e)}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def _train(cfg, cache, peak_flops, peak_source, rank, world, attempt, device, beats) -> None:
    torch.manual_seed(cfg.train.seed)
    par = build_parallel(cfg, device, rank, world)
    t, lay = cfg.train, par.layout
    seq = cfg.data.seq_len
    B = t.global_batch
    per_dp = B // lay.dp
    stream = SampleStream(cache, seq, t.seed, cfg.data.holdout_fraction)
    opt = build_optimizer(par, cfg)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else _no_amp
    run_dir = Path(cfg.run.dir)
    ckpt = Checkpointer(
        cfg,
        par.stages,
        opt,
        layout=str(lay),
        contributes=all(par.coords[d] == 0 for d in ("tp", "cp", "dp")),
        attempt=attempt,
        info={"seed": t.seed, "global_batch": B, "steps": t.steps},
    )
    start_step, start_sample = ckpt.resume() or (0, 0)
    if start_step > t.steps:
        raise FourdError(
            f"{run_dir} has a checkpoint at step {start_step}, beyond --steps {t.steps}: "
            "ask for more steps or use another --run-dir"
        )
    writer = MetricsWriter(run_dir, t.steps, start_step) if rank == 0 else None
    flops_per_step = model_config(cfg).flops_per_token(seq) * B * seq
    if rank == 0:
        print(
            f"fourd train: {cfg.model.preset} model, layout {lay} ({world} rank{'s' if world > 1 else ''}, "
            f"{device.type}), {B} x {seq} tokens per step, data: {cache.source}",
            flush=True,
        )
    for step in range(start_step + 1, t.steps + 1):
        if attempt == 0 and step == cfg.fault.at_step and rank == cfg.fault.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 0 and step == cfg.fault.at_step and rank == cfg.fault.hang_rank:
            time.sleep(10 * t.timeout_s)
        beats.beat(step)
        ckpt.poll()
        t0 = time.perf_counter()
        first = start_sample + (step - start_step - 1) * B  # the global sample index: same stream at any dp
        x, y = _batch(par, stream, first, per_dp, device)
        lr = lr_at(step, cfg)
        loss, grad_norm = train_step(par, opt, x, y, lr, cfg, amp)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if writer is not None:
            row = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": B * seq / dt,
                "step_time_s": dt,
                "mfu": flops_per_step / dt / (peak_flops * (world if device.type == "cuda" else 1)),
                "peak_mem_gb": peak_memory_gb(device.type),
                "tokens": step * B * seq,
            }
            if par.runner is not None:
                row["bubble_fraction"] = par.runner.bubble_fraction
            writer.log(row, show=step % t.log_every == 0 or step == t.steps)
        if step == t.steps and par.runner is not None and cfg.run.trace:
            _write_trace(par, run_dir / "trace.json")
        interval = cfg.checkpoint.interval
        if step == t.steps or (interval and step % interval == 0):
            ckpt.save(step, first + B)
    ckpt.wait()
    if writer is not None:
        writer.close()
        print(
            summary_table(
                writer.rows,
                {
                    "layout": f"{lay} on {world} {device.type} rank(s)",
                    "MFU peak": f"{peak_flops / 1e12:.3f} TFLOP/s ({peak_source})",
                    "run dir": str(run_dir),
                },
            ),
            flush=True,
        )


def _batch(par: Parallel, stream: SampleStream, first: int, per_dp: int, device):
    """This rank's inputs and targets of the step whose global batch starts at sample `first`."""
    batch = torch.from_numpy(stream.samples(first + par.data_rank * per_dp, per_dp)).to(device)
    x, y = batch[:, :-1], batch[:, 1:]
    if par.layout.cp > 1:
        from fourd.parallel.cp import cp_shard

        x, y = (cp_shard(v, par.coords["cp"], par.layout.cp, dim=1) for v in (x, y))
    return x, y


def _write_trace(par: Parallel, path: Path) -> None:
    """The pipeline actions of this step on every rank, as one Chrome trace (opens in Perfetto and the lab)."""
    c = par.coords
    events = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": par.rank,
            "args": {"name": f"rank {par.rank} (pp={c['pp']} tp={c['tp']} cp={c['cp']} dp={c['dp']})"},
        }
    ]
    events += par.runner.trace_events(pid=par.rank)
    gathered: Any = [None] * dist.get_world_size() if par.rank == 0 else None
    dist.gather_object(events, gathered, dst=0)
    if par.rank == 0:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"traceEvents": [e for rank_events in gathered for e in rank_events], "displayTimeUnit": "ms"})
        )
        os.replace(tmp, path)


class _no_amp:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def worker_entry(cfg_dict: dict, cache: TokenCache, peak_flops: float, peak_source: str) -> None:
    """The function each launched process runs (picklable for the elastic launcher)."""
    cfg = Config.from_dict(cfg_dict)
    try:
        run_worker(cfg, cache, peak_flops, peak_source)
    except FourdError as e:
        print(f"fourd: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
