"""Checkpoints of a running job: sharded save (sync or async), resume at any layout, retention
(what a checkpoint holds, the commit protocol, how resuming chooses: docs/fault-tolerance.md)."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fourd.ckpt import store
from fourd.ckpt.safe_reader import SafeReader
from fourd.config import Config, model_config
from fourd.errors import FourdError

# Fault injection: "RANK@STEP" SIGKILLs RANK in the save of STEP, after the data files, before the
# manifest.
KILL_IN_SAVE_ENV = "FOURD_FAULT_KILL_IN_SAVE"


def gathered_digest(model_sd: dict[str, torch.Tensor], contributes: bool) -> str | None:
    """The whole model's digest on rank 0 (None elsewhere); one rank per stage (`contributes`) sends
    its part."""
    full = {name: store.full(model_sd[name]) for name in sorted(model_sd)}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return store.model_digest(full)
    on_root = dist.get_rank() == 0
    parts: list | None = None  # what each rank sends, gathered on rank 0
    if on_root:
        parts = [None] * dist.get_world_size()
    sent = None
    if contributes:
        sent = full
    dist.gather_object(sent, parts, dst=0)
    if not on_root:
        return None
    merged = {name: tensor for part in parts or [] for name, tensor in (part or {}).items()}
    return store.model_digest(merged)


class Checkpointer:
    """This rank's stages and optimizer, saved under cfg.run.dir with `cfg` and `info`; methods are
    collectives."""

    def __init__(
        self,
        cfg: Config,
        stages: list[nn.Module],
        optimizer,
        *,
        layout: str,
        contributes: bool,
        attempt=0,
        info=None,
    ):
        self.run_dir = Path(cfg.run.dir)
        self.root = self.run_dir / store.CHECKPOINTS
        # Stages under "0.", "1.", ... so one optimizer maps to names; saved under the names without
        # the prefix.
        self.module = nn.ModuleDict({str(i): stage for i, stage in enumerate(stages)})
        self.optimizer = optimizer
        self.layout = layout  # the layout string the manifest records
        self.contributes = contributes  # this rank sends its stage's part of the model digest
        self.model_cfg = model_config(cfg)
        self.keep = cfg.checkpoint.keep  # complete checkpoints kept, newest first
        self.async_save = cfg.checkpoint.async_save
        self.attempt = attempt  # restarts so far of this run
        self.info = {"config": cfg.to_dict(), **(info or {})}
        self.rank = 0
        self.world = 1
        if dist.is_initialized():
            self.rank = dist.get_rank()
            self.world = dist.get_world_size()
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Asynchronous saves run their collectives on their own gloo group, never interleaved with a
        # step's.
        self.async_group = None
        if self.async_save and dist.is_initialized():
            self.async_group = dist.new_group(backend="gloo")
        # (future, (step, final dir, staging dir, digest, manifest extra))
        self.pending: tuple | None = None

    def _state(self) -> tuple[dict, dict, dict, dict]:
        msd, osd = get_state_dict(self.module, self.optimizer, options=self.options)
        model = {key.split(".", 1)[1]: value for key, value in msd.items()}
        optim = {
            "state." + key.split(".", 2)[2]: value
            for key, value in osd.items()
            if key.startswith("state.")
        }
        return model, optim, msd, osd

    def _broadcast(self, value):
        box = [value]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def save(self, step: int, samples: int, extra: dict | None = None) -> None:
        """Write checkpoint step-<step>; returns when it is committed (sync) or staged (async)."""
        self.wait()
        self.started = time.perf_counter()
        self.blocked = None  # seconds training waited for an asynchronous save
        final = self.root / f"step-{step}"
        tmp = store.staging_dir(final)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.world > 1:
            dist.barrier()
        model, optim, _, _ = self._state()
        train = {"step": torch.tensor(step), "samples": torch.tensor(samples)}
        state = {
            "model": model,
            "optim": optim,
            "train": {**train, f"rng_rank{self.rank}": torch.get_rng_state()},
        }
        extra = {"train": {"step": step, "samples": samples, **self.info, **(extra or {})}}
        pending = (step, final, tmp, gathered_digest(model, self.contributes), extra)
        writer = dcp.FileSystemWriter(str(tmp))
        future: list = []
        save = dcp.save
        if self.async_save:
            save = partial(dcp.async_save, process_group=self.async_group)
        error = _error_of(lambda: future.append(save(state, storage_writer=writer)))
        if self.async_save and error is None:
            self.pending = (future[0], pending)
            self.blocked = time.perf_counter() - self.started
            return
        self._finish(pending, error)

    def poll(self) -> None:
        """Commit a finished asynchronous save (cheap when none is pending)."""
        if self.pending is not None:
            done = torch.tensor(int(self.pending[0].done()))
            if self.world > 1:
                dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                self.wait()

    def wait(self) -> None:
        """Wait for an asynchronous save to finish and commit it."""
        if self.pending is not None:
            future, pending = self.pending
            self.pending = None
            self._finish(pending, _error_of(future.result))

    def _finish(self, pending: tuple, error: str | None) -> None:
        step, final, tmp, digest, extra = pending
        rank, _, kill_step = os.environ.get(KILL_IN_SAVE_ENV, "").partition("@")
        if self.attempt == 0 and kill_step and int(rank) == self.rank and int(kill_step) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 0 and error is None:
            try:
                written = store.write_manifest(
                    tmp, self.model_cfg, digest, step, self.layout, extra
                )
                store.commit(tmp, final)
            except (OSError, FourdError) as exc:
                error = _describe(exc)
        error = self._broadcast(error)
        if error is not None:
            kept = "see rank 0"
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                # the failed one is gone
                previous = next(iter(store.checkpoints(self.run_dir)), None)
                error += f" ({_storage_state(self.root)})"
                kept = "there is no earlier checkpoint"
                if previous:
                    kept = f"the newest complete checkpoint, {previous[1].name}, is intact"
            raise FourdError(
                f"checkpoint step-{step} was not saved: {error}; {kept}; "
                f"free space under {self.root} (or lower checkpoint.keep) and run again to resume"
            )
        if self.rank == 0:
            size = sum(entry["bytes"] for entry in written["files"].values()) / 1e6
            took = time.perf_counter() - self.started
            how = f"{took:.2f} s"
            if self.blocked is not None:
                how = (
                    f"asynchronous: committed {took:.2f} s after it began, training waited "
                    f"{self.blocked:.2f} s"
                )
            print(
                f"fourd: checkpoint {final} saved (step {step}, {size:.1f} MB, {how})", flush=True
            )
            for _step, path in store.checkpoints(self.run_dir)[self.keep :]:
                shutil.rmtree(path, ignore_errors=True)

    def resume(self) -> tuple[int, int] | None:
        """Load the newest checkpoint that verifies; (step, samples), or None to start afresh."""
        choice: str | FourdError | None = None
        if self.rank == 0:
            try:
                choice = self._choose()
            except FourdError as error:
                choice = error
        choice = self._broadcast(choice)
        if isinstance(choice, FourdError):
            raise choice
        if choice is None:
            return None
        return self._load(Path(choice))

    def _load(self, directory: Path) -> tuple[int, int]:
        reader = SafeReader(str(directory))
        saved = reader.read_metadata().state_dict_metadata
        model, optim, msd, osd = self._state()
        missing = sorted(f"model.{name}" for name in model if f"model.{name}" not in saved)
        if missing:
            raise FourdError(f"{directory}: has no tensor {missing[0]}; it holds another model")
        rng_key = f"rng_rank{self.rank}"
        saved_layout = store.read_manifest(directory)["layout"]
        train = {
            "step": torch.zeros((), dtype=torch.int64),
            "samples": torch.zeros((), dtype=torch.int64),
        }
        # RNG states only at the same layout
        if saved_layout == self.layout and f"train.{rng_key}" in saved:
            train[rng_key] = torch.get_rng_state()
        dcp.load({"model": model, "optim": optim, "train": train}, storage_reader=reader)
        self._restore(model, optim, msd, osd)
        if rng_key in train:
            torch.set_rng_state(train[rng_key])
        step, samples = int(train["step"]), int(train["samples"])
        if self.rank == 0:
            after = ""
            if self.attempt:
                after = f" after restart {self.attempt}"
            where = ""
            if saved_layout != self.layout:
                where = f" (saved at layout {saved_layout}, resharded to {self.layout})"
            line = (
                f"fourd: resuming{after} from checkpoint {directory} at step {step}, sample "
                f"{samples}{where}"
            )
            print(line, flush=True)
        return step, samples

    def _restore(self, model: dict, optim: dict, msd: dict, osd: dict) -> None:
        """Loaded canonical names back to the prefixed names the module and optimizer know."""
        prefixed = {key.split(".", 1)[1]: key for key in msd}

        def param_name(key: str) -> str:  # state.<canonical name>.<kind> -> the prefixed name
            return prefixed[key.removeprefix("state.").rsplit(".", 1)[0]]

        for key, value in optim.items():
            osd[f"state.{param_name(key)}.{key.rsplit('.', 1)[1]}"] = value
        model_sd = {prefixed[key]: value for key, value in model.items()}
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=osd,
            options=self.options,
        )

    def _choose(self) -> str | None:
        """Rank 0: the newest checkpoint that verifies; partial and damaged ones are set aside
        loudly."""
        for staged in sorted(self.root.glob(".step-*.partial")):
            store.warn(
                f"ignoring the incomplete checkpoint {staged} (a save was interrupted); removing it"
            )
            shutil.rmtree(staged, ignore_errors=True)

        def set_aside(path: Path, error: FourdError) -> str:  # store.newest's one line says it
            aside = path.with_name(f"{path.name}.damaged")
            count = 1
            while aside.exists():
                count += 1
                aside = path.with_name(f"{path.name}.damaged{count}")
            path.rename(aside)
            return f"moved it to {aside.name}"

        path = store.newest(self.run_dir, check=store.verify, on_damaged=set_aside)
        if path is None:
            return None
        store.check_model(path, self.model_cfg)
        return str(path)


def _storage_state(root: Path) -> str:
    """What a failed write may have run into: a full file system or a file-size limit."""
    state = f"{shutil.disk_usage(root).free / 2**30:.2f} GiB free there"
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        state += f", a file-size limit of {soft:,} bytes (ulimit -f)"
    return state


def _error_of(work) -> str | None:
    """None when work() succeeds, else its error in one line (DCP raises the same error on every
    rank)."""
    try:
        work()
    except (Exception, CheckpointException) as error:
        return _describe(error)
    return None


def _describe(error: BaseException) -> str:
    """One line for an error that may be DCP's wrapper around the failures of several ranks."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (inner, _trace) = min(error.failures.items())
        return f"rank {rank}: {_describe(inner)}"
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.strerror} ({error.filename})"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {error}".splitlines()[0]
