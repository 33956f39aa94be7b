"""One training worker: build the model, apply the layout's parallelism from outside, run the loop.

Parallelism is applied in the order of the mesh: pipeline split → TP → CP → DP (FSDP over dp×cp).
Every rank sees the same global batch of the same step (the data order depends on the seed only), so
any layout reproduces the single-process run up to floating-point rounding.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fourd.ckpt.dcp_io import Checkpointer
from fourd.config import Config, model_config
from fourd.data.dataset import SampleStream, TokenCache
from fourd.errors import FourdError
from fourd.layout import Layout, parse_layout
from fourd.model.llama import build_model
from fourd.parallel.grad import clip_grad_norm
from fourd.train.heartbeat import Heartbeat
from fourd.train.metrics import MetricsWriter, peak_memory_gb, summary_table


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to train.lr, then cosine decay to train.min_lr at the last step (step counts from 1)."""
    t = cfg.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class Parallel:
    """This rank's place in the layout and the pieces that run its part of the model."""

    layout: Layout
    rank: int
    coords: dict
    mesh: object | None
    stages: list[torch.nn.Module]
    runner: Any  # the pipeline executor (PipelineRunner) when pp > 1, else None

    @property
    def data_rank(self) -> int:
        return self.coords["dp"]


def build_parallel(cfg: Config, device: torch.device, rank: int, world: int) -> Parallel:
    layout = parse_layout(cfg.parallel.layout)
    if layout.world != world:
        raise FourdError(
            f"layout {layout} needs {layout.world} ranks but {world} were started: "
            f"start {layout.world} workers or change --layout"
        )
    mcfg = model_config(cfg)
    coords = layout.coords(rank)
    seed = cfg.train.seed
    if world == 1:
        model = build_model(mcfg, seed=seed, device=device)
        return Parallel(layout, rank, coords, None, [model], None)

    from fourd.parallel.mesh import build_mesh, dp_cp_mesh

    hsdp = cfg.parallel.hsdp_replicas if cfg.parallel.hsdp_replicas > 1 else None
    mesh = build_mesh(layout, device.type, hsdp_replicate=hsdp)
    runner = None
    if layout.pp > 1:
        from fourd.parallel.pp import pipeline_split
        from fourd.schedules import build_schedule

        schedule = build_schedule(
            cfg.parallel.schedule, layout.pp, cfg.parallel.microbatches, cfg.parallel.virtual_stages
        )
        stages = pipeline_split(mcfg, coords["pp"], schedule, seed=seed, device=device)
    else:
        schedule = None
        stages = [build_model(mcfg, seed=seed, device=device)]
    if layout.tp > 1:
        from fourd.parallel.tp import apply_tp

        for s in stages:
            apply_tp(s, mesh["tp"], sequence_parallel=cfg.parallel.sequence_parallel)
    if layout.cp > 1:
        from fourd.parallel.cp import apply_cp

        for s in stages:
            apply_cp(s, mesh["cp"], cfg.data.seq_len)
    group_mesh = None
    if layout.dp * layout.cp > 1:
        from fourd.parallel.dp import apply_dp

        group_mesh = dp_cp_mesh(mesh)
        for s in stages:
            apply_dp(s, group_mesh, _dp_mode(cfg))
    if schedule is not None:
        from fourd.parallel.pp import PipelineRunner

        runner = PipelineRunner(stages, schedule, mesh["pp"], _loss_fn(layout), device=device)
    return Parallel(layout, rank, coords, mesh, stages, runner)


def _dp_mode(cfg: Config) -> str:
    zero = cfg.parallel.zero
    if zero == 1:
        raise FourdError("ZeRO stage 1 is not implemented yet: use parallel.zero = 0, 2 or 3")
    return {0: "ddp", 2: "zero2", 3: "hsdp" if cfg.parallel.hsdp_replicas > 1 else "zero3"}[zero]


def _param_groups(stages, weight_decay: float):
    decay: list = []
    no_decay: list = []
    for s in stages:
        for name, p in s.named_parameters():
            (no_decay if name.endswith("norm.weight") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in nats (float32 whatever the compute dtype)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _loss_fn(layout: Layout):
    if layout.tp > 1:
        from fourd.parallel.tp import loss_fn

        return loss_fn
    return cross_entropy


def _forward_backward(par: Parallel, x: torch.Tensor, y: torch.Tensor, microbatches: int, amp) -> torch.Tensor:
    """Without a pipeline: accumulate each microbatch's mean loss / M. Returns the rank's mean loss."""
    loss_fn = _loss_fn(par.layout)
    model = par.stages[0]
    total = torch.zeros((), device=x.device)
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    for i, (xm, ym) in enumerate(zip(xs, ys)):
        sync = i == microbatches - 1
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync)
        with amp():
            loss = loss_fn(model(xm), ym) / microbatches
        loss.backward()
        total += loss.detach()
    return total


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
    B, M = t.global_batch, cfg.parallel.microbatches
    per_dp = B // lay.dp
    stream = SampleStream(cache, seq, t.seed, cfg.data.holdout_fraction)
    params = [p for s in par.stages for p in s.parameters()]
    opt = torch.optim.AdamW(
        _param_groups(par.stages, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, foreach=False
    )
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else _no_amp
    run_dir = Path(cfg.run.dir)
    ckpt = Checkpointer(
        run_dir,
        par.stages,
        opt,
        model_cfg=model_config(cfg),
        layout=str(lay),
        contributes=all(par.coords[d] == 0 for d in ("tp", "cp", "dp")),
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
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
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        first = start_sample + (step - start_step - 1) * B  # the global sample index: same stream at any dp
        batch = torch.from_numpy(stream.samples(first + par.data_rank * per_dp, per_dp)).to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        if lay.cp > 1:
            from fourd.parallel.cp import cp_shard

            x, y = (cp_shard(v, par.coords["cp"], lay.cp, dim=1) for v in (x, y))
        if par.runner is not None:
            with amp():
                loss = par.runner.step(x, y)
        else:
            loss = _forward_backward(par, x, y, M, amp)
        grad_norm = clip_grad_norm(params, t.grad_clip, par.mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float().reshape(())
        if world > 1:
            # TP and PP ranks hold equal copies of their replica's loss: the world mean is the
            # mean over the dp×cp ranks, i.e. over the global batch.
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if writer is not None:
            row = {
                "step": step,
                "loss": loss.item(),
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
