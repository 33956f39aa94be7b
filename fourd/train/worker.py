"""One training worker: the parallel model, then the loop around fourd.train.step (fault injection,
heartbeat, held-out evaluation, metrics, checkpoints, and a stop signal the ranks agree on at each
step boundary)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from fourd.ckpt.dcp_io import Checkpointer
from fourd.ckpt.store import newest
from fourd.config import Config, model_config
from fourd.data.dataset import TokenCache
from fourd.errors import FourdError, RunFailed, plural
from fourd.hf.convert import load_weights
from fourd.measure.peak import peak_memory_gb
from fourd.parallel.apply import build_parallel
from fourd.parallel.cp import cp_shard
from fourd.sim.trace import document, label, span, write_trace
from fourd.train.anchor_file import write_anchor
from fourd.train.auto import predict, resident_bytes, use_cuda
from fourd.train.heartbeat import Heartbeat
from fourd.train.launch import LAUNCH_DIR_ENV, attempt, outcome
from fourd.train.metrics import MetricsWriter, mfu_peak, summary_table
from fourd.train.step import build_optimizer, eval_step, lr_at, train_step

_STOP = {"signal": 0}  # the signal that asked this worker to stop; 0: none


def _ask_to_stop(signum: int, frame) -> None:
    """SIGINT and SIGTERM: remember the signal; the ranks agree on it at the next step boundary."""
    _STOP["signal"] = signum


def listen_for_stop() -> None:
    """Take SIGINT and SIGTERM as a request to stop at the next step boundary, not as an end."""
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, _ask_to_stop)


def worker_entry(
    cfg_dict: dict, cache: TokenCache, data: dict, peak: tuple[float, str]
) -> int | str:
    """What each launched process runs: 0 when the run ended, the signal that stopped it, or the
    message of a failure every rank met at once (a diverged loss: no restart can help). Other
    failures exit non-zero."""
    listen_for_stop()
    cfg = Config.from_dict(cfg_dict)
    try:
        return run_worker(cfg, cache, data, peak)
    except Exception as e:
        _report(e, cfg)
        end_process(2 if type(e) is FourdError else 1)


def torchrun_worker(
    cfg_dict: dict, cache: TokenCache, data: dict, peak: tuple[float, str]
) -> NoReturn:
    """A worker torchrun started: it runs as `worker_entry`, says a failure every rank met at
    once in one line, and ends with the run's exit status (no launcher of fourd's collects it)."""
    result = worker_entry(cfg_dict, cache, data, peak)
    try:
        code = outcome([result])
    except RunFailed as error:
        print(f"fourd: error: {error}", file=sys.stderr)
        code = error.exit_code
    end_process(code)


def end_process(code: int) -> NoReturn:
    """Exit now, without the interpreter's finalization. A worker's process groups are destroyed by
    then, but gloo's threads torn down during finalization still abort the process now and then
    ("terminate called without an active exception", SIGABRT): after a failure's one line it
    adds a second, and after a run that ended well under torchrun the agent sees exit -6 and fails
    the job. Whatever the run writes is closed before this (`_Run._end`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(e: Exception, cfg: Config) -> None:
    """Leave a failure's one line for the launcher (printed once), or print it when the job will
    restart."""
    message = str(e) if isinstance(e, FourdError) else f"{type(e).__name__}: {e}".splitlines()[0]
    if os.environ.get("FOURD_DEBUG"):
        traceback.print_exc()
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if attempt() < cfg.run.max_restarts and type(e) is not FourdError:
        print(
            f"fourd: warning: {message}; the job restarts from the newest checkpoint",
            file=sys.stderr,
            flush=True,
        )
    elif folder is None:
        print(f"fourd: error: {message}", file=sys.stderr, flush=True)
    if folder is not None:
        rank, code = int(os.environ.get("RANK", 0)), 2 if type(e) is FourdError else 1
        report = dict(rank=rank, attempt=attempt(), time=time.time(), message=message, code=code)
        Path(folder, f"rank-{rank}.json").write_text(json.dumps(report))


def run_worker(cfg: Config, cache: TokenCache, data: dict, peak: tuple[float, str]) -> int | str:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if use_cuda(cfg) else torch.device("cpu")
    cuda = {"device_id": device} if device.type == "cuda" else {}
    if cuda:
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    timeout = timedelta(seconds=cfg.train.timeout_s)
    # The elastic agent keeps one TCP store for all restarts of the job: without a key prefix per
    # attempt, a restarted worker would read its peers' addresses from the failed attempt and hang.
    store = dist.PrefixStore(
        f"fourd/attempt{attempt()}", next(dist.rendezvous("env://", timeout=timeout))[0]
    )
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, **cuda
    )
    # The digest gathers 2-D-sharded parameters once per checkpoint; DTensor's advice on merging
    # those all-gathers is about throughput, not correctness, and would flood every rank's log.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    beats = Heartbeat(rank, world, store)
    try:
        return _Run(cfg, cache, data, peak, device, beats).loop()
    except FourdError:
        raise
    except Exception as e:
        # A collective that timed out or lost a peer: say which rank did not keep up, and at which
        # step.
        raise RunFailed(f"rank {rank}: {beats.report(e)}") from e
    finally:
        dist.destroy_process_group()


def checkpoint_due(step: int, steps: int, interval: int) -> bool:
    """Whether a checkpoint is saved after `step` of `steps`: every `interval` steps (0: none
    between) and at the last step (the contract's `fourd train` section)."""
    return step == steps or bool(interval and step % interval == 0)


class _Run:
    """A worker's run: its part of the model, the optimizer, data, checkpointer and outputs; `loop`
    trains."""

    def __init__(
        self,
        cfg: Config,
        cache: TokenCache,
        data: dict,
        peak: tuple[float, str],
        device,
        beats,
    ):
        self.cfg = cfg
        self.device = device
        self.beats = beats
        self.peak = peak  # (FLOP/s, where the figure comes from)
        self.baseline_bytes = 0.0  # what the process holds besides its model's tensors (loop)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.attempt = attempt()
        torch.manual_seed(cfg.train.seed)
        self.par = build_parallel(cfg, device, self.rank, self.world)
        self.opt = build_optimizer(self.par, cfg)
        cuda = device.type == "cuda"
        self.amp = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
            if cuda
            else contextlib.nullcontext
        )
        self.stream = cache.stream(cfg.data.seq_len, cfg.train.seed, cfg.data.holdout_fraction)
        self.dir = Path(cfg.run.dir)
        first = all(
            self.par.coords[d] == 0 for d in ("tp", "cp", "dp")
        )  # one rank per stage sends its weights
        lay, info = str(self.par.layout), {"data": data}
        self.ckpt = Checkpointer(
            cfg,
            self.par.stages,
            self.opt,
            layout=lay,
            contributes=first,
            attempt=self.attempt,
            info=info,
        )
        self.writer: MetricsWriter | None = None
        self.per_dp = cfg.train.global_batch // self.par.layout.dp
        self.offset = (
            self.par.coords["dp"] * self.per_dp
        )  # this rank's first sample in a global batch: any dp
        self.tokens = cfg.train.global_batch * cfg.data.seq_len
        flops = model_config(cfg).flops_per_token
        # the model's FLOPs (MFU), and the hardware's with what recomputation repeats (HFU)
        self.flops_per_step = flops(cfg.data.seq_len) * self.tokens
        self.hw_flops_per_step = flops(cfg.data.seq_len, self.par.setting.recompute) * self.tokens
        self.peak_total = mfu_peak(peak[0], self.world, device.type)

    def loop(self) -> int | str:
        t, interval = self.cfg.train, self.cfg.checkpoint.interval
        step, sample = self.ckpt.resume() or (0, 0)
        if step == 0 and self.attempt and self.rank == 0:
            print(
                f"fourd: restart {self.attempt}: no checkpoint yet, training again from step 1",
                flush=True,
            )
        if step == 0 and t.init_from:
            self._init_weights()
        if step > t.steps:
            raise FourdError(
                f"{self.dir} has a checkpoint at step {step}, beyond train.steps = {t.steps}: "
                "ask for more --steps"
            )
        self.writer = MetricsWriter(self.dir, t.steps, step) if self.rank == 0 else None
        # Before the first step: the interpreter, torch, the data, the process groups, the model's
        # machinery and outputs; the planner counts the tensors that come with training.
        self.baseline_bytes = resident_bytes() - self._parameter_bytes()
        saved = step
        first_save: int | None = None  # the step after which this run first saved a checkpoint
        while step < t.steps:
            step += 1
            row = self._step(step, sample)
            sample += t.global_batch
            if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
                return self._end(self._diverged(row))
            if self.writer is not None:
                self.writer.log(row, show=step % t.log_every == 0 or step == t.steps)
            if checkpoint_due(step, t.steps, interval):
                self.ckpt.save(step, sample)
                saved = step
                if first_save is None:
                    first_save = step
            stop = self._stop_agreed()
            if stop and step < t.steps:
                if saved != step:
                    self.ckpt.save(step, sample)
                saved_at = f"checkpoint {self.dir}/checkpoints/step-{step} saved"
                resume = f"continue with `fourd train --resume {self.dir}`"
                name = signal.Signals(stop).name
                return self._end(stop, f"stopped by {name} after step {step}; {saved_at}; {resume}")
        if self.writer is None:
            return self._end(0)
        peak_flops, peak_source = self.peak
        ranks = plural(self.world, self.device.type + " rank")
        facts = {
            "layout": f"{self.par.layout} on {ranks}",
            "run dir": str(self.dir),
            "MFU peak": f"{peak_flops / 1e12:.3f} TFLOP/s, {peak_source}",
        }
        write_anchor(self.dir, self.cfg, self.writer.rows, self.device.type)  # fourd plan --anchor
        predicted = predict(self.cfg, peak_flops, self.world, self.device.type, self.baseline_bytes)
        summary = summary_table(self.writer.rows, facts, predicted, first_save)
        return self._end(0, summary)

    def _parameter_bytes(self) -> int:
        """Bytes of this rank's own parameters (its shards of sharded ones)."""
        total = 0
        for stage in self.par.stages:
            for param in stage.parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                total += local.numel() * local.element_size()
        return total

    def _end(self, result: int | str, text: str = ""):
        self.ckpt.wait()
        if self.writer is not None:
            self.writer.close()
            if text and result == 0:
                print(text, flush=True)
            elif text:  # a non-zero exit: its line goes where every other such line goes
                print(f"fourd: {text}", file=sys.stderr, flush=True)
        return result

    def _diverged(self, row: dict) -> str:
        last = newest(self.dir)
        kept = (
            f"the newest checkpoint, {last}, is kept"
            if last
            else "no checkpoint was saved before it"
        )
        return (
            f"step {row['step']}: the loss is {row['loss']} and the gradient norm "
            f"{row['grad_norm']}: training diverged; {kept}, and nothing of this step was saved: "
            f"lower train.lr (it is {self.cfg.train.lr:g})"
        )

    def _step(self, step: int, sample: int) -> dict:
        cfg = self.cfg
        if self.attempt == 0 and step == cfg.fault.at_step:
            if self.rank == cfg.fault.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.rank == cfg.fault.hang_rank:
                time.sleep(10 * cfg.train.timeout_s)
        self.beats.beat(step)
        self.ckpt.poll()
        start = time.perf_counter()
        x, y = self._inputs(self.stream.samples(sample + self.offset, self.per_dp))
        lr = lr_at(step, cfg)
        loss, grad_norm = train_step(self.par, self.opt, x, y, lr, cfg, self.amp)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        row = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": self.tokens / seconds,
            "step_time_s": seconds,
            "mfu": self.flops_per_step / seconds / self.peak_total,
            "tokens": step * self.tokens,
            "hfu": self.hw_flops_per_step / seconds / self.peak_total,
        }
        row["peak_mem_gb"] = peak_memory_gb(self.device.type)
        if self.par.runner is not None:
            row["bubble_fraction"] = self.par.runner.bubble_fraction
            if step == cfg.train.steps and cfg.run.trace:
                self._write_trace(self.dir / "trace.json")
        every = cfg.eval.every
        if every and (step % every == 0 or step == cfg.train.steps) and math.isfinite(loss):
            row.update(self._evaluate())
        return row

    def _inputs(self, rows: np.ndarray):
        """This rank's inputs and targets from its [sequences, seq_len + 1] token windows."""
        batch = torch.from_numpy(rows).to(self.device)
        x, y = batch[:, :-1], batch[:, 1:]
        if self.par.layout.cp > 1:
            x, y = (cp_shard(v, self.par.coords["cp"], self.par.layout.cp, dim=1) for v in (x, y))
        return x, y

    def _evaluate(self) -> dict:
        """Held-out loss and perplexity over the first eval.batches global batches of the corpus
        tail that training never reads: the same windows, so the same figure, at every layout."""
        seq, batch = self.cfg.data.seq_len, self.cfg.train.global_batch
        tail = self.stream.holdout()
        batches = min(self.cfg.eval.batches, (len(tail) - 1) // seq // batch)
        total = 0.0
        for index in range(batches):
            first = index * batch + self.offset
            rows = np.stack(
                [tail[(first + k) * seq : (first + k + 1) * seq + 1] for k in range(self.per_dp)]
            )
            x, y = self._inputs(rows)
            total += eval_step(self.par, self.opt, x, y, self.cfg, self.amp)
        mean = total / batches
        return {"val_loss": mean, "val_ppl": math.exp(min(mean, 700.0))}

    def _stop_agreed(self) -> int:
        """The signal that stops the run at this step boundary, agreed by every rank; 0: go on."""
        stop, folder = _STOP["signal"], os.environ.get(LAUNCH_DIR_ENV)
        if not stop and folder and os.path.exists(os.path.join(folder, "stop")):
            stop = int(Path(folder, "stop").read_text() or signal.SIGTERM)
        flag = torch.tensor(stop, device=self.device)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def _init_weights(self) -> None:
        """Start from train.init_from's weights: the full state dict on every rank, each keeping its
        part."""

        _, weights = load_weights(self.cfg.train.init_from)
        for stage in self.par.stages:
            part = {k: weights[k] for k in stage.state_dict()}
            set_model_state_dict(stage, part, options=StateDictOptions(full_state_dict=True))
        if self.rank == 0:
            print(f"fourd: starting from the weights of {self.cfg.train.init_from}", flush=True)

    def _write_trace(self, path: Path) -> None:
        """This step's pipeline actions on every rank, as one Chrome trace (opens in Perfetto and
        the lab)."""
        rank = self.rank
        where = " ".join(f"{dim}={self.par.coords[dim]}" for dim in ("pp", "tp", "cp", "dp"))
        events = [label(rank, None, f"rank {rank} ({where})")]
        for action in self.par.runner.records:
            name = f"{action.kind}{action.stage}.{action.microbatch}"
            took = action.end - action.start
            where_in = {"stage": action.stage, "microbatch": action.microbatch}
            events.append(span(rank, 0, name, action.kind, action.start, took, **where_in))
        gathered: list | None = [None] * self.world if rank == 0 else None
        dist.gather_object(events, gathered, dst=0)
        if gathered is not None:
            write_trace(document([e for part in gathered for e in part]), path)
