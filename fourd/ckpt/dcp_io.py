"""Checkpoints of a running job: sharded save (sync or async), resume at any layout, retention.

What a checkpoint holds, the commit protocol and how resuming chooses: docs/fault-tolerance.md.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fourd.ckpt import store
from fourd.ckpt.safe_reader import SafeReader
from fourd.errors import FourdError
from fourd.model.config import ModelConfig

# Fault injection: "RANK@STEP" SIGKILLs RANK during the save of STEP, after the data files are written
# and before the manifest (first attempt only).
KILL_IN_SAVE_ENV = "FOURD_FAULT_KILL_IN_SAVE"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir, store.CHECKPOINTS, f"step-{step}")


def gathered_digest(model_sd: dict[str, torch.Tensor], contributes: bool) -> str | None:
    """store.model_digest of the whole model when each pipeline stage holds a part (a collective).

    One rank per stage (`contributes`) sends its stage's full tensors to rank 0, which hashes them:
    rank 0 holds one full copy of the model. Returns the digest on rank 0, None elsewhere.
    """
    full = {name: store.full(model_sd[name]) for name in sorted(model_sd)}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return store.model_digest(full)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(full if contributes else None, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict = {}
    for part in parts or []:
        merged.update(part or {})
    return store.model_digest(merged)


class Checkpointer:
    """Saves and restores this rank's stages and optimizer; all methods are collectives."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        stages: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        *,
        model_cfg: ModelConfig,
        layout: str,
        contributes: bool,
        keep: int,
        async_save: bool = False,
        attempt: int = 0,
        info: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / store.CHECKPOINTS
        # Stages under "0.", "1." ... so that one optimizer over all of them maps to names; the prefix
        # is stripped to the canonical name before saving.
        self.module = nn.ModuleDict({str(i): s for i, s in enumerate(stages)})
        self.optimizer, self.model_cfg, self.layout = optimizer, model_cfg, layout
        self.contributes, self.keep, self.attempt, self.info = contributes, keep, attempt, info or {}
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Asynchronous saves run their collectives on their own gloo group, never interleaved with a step's.
        self.async_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self.async_save = async_save
        self.pending: tuple | None = None  # (future, (step, final dir, staging dir, digest, manifest extra))

    def _state(self) -> tuple[dict, dict, dict, dict]:
        msd, osd = get_state_dict(self.module, self.optimizer, options=self.options)
        model = {k.split(".", 1)[1]: v for k, v in msd.items()}
        optim = {
            "state." + k.removeprefix("state.").split(".", 1)[1]: v for k, v in osd.items() if k.startswith("state.")
        }
        return model, optim, msd, osd

    def _broadcast(self, value):
        if self.world > 1:
            box = [value]
            dist.broadcast_object_list(box, src=0)
            value = box[0]
        return value

    # saving ------------------------------------------------------------------------------------
    def save(self, step: int, samples: int, extra: dict | None = None) -> None:
        """Write checkpoint step-<step>; returns when it is committed (sync) or staged (async)."""
        self.wait()
        self.started, self.blocked = time.perf_counter(), None
        final = checkpoint_dir(self.run_dir, step)
        tmp = store.staging_dir(final)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.world > 1:
            dist.barrier()
        model, optim, _, _ = self._state()
        train = {"step": torch.tensor(step), "samples": torch.tensor(samples)}
        train[f"rng_rank{self.rank}"] = torch.get_rng_state()
        state = {"model": model, "optim": optim, "train": train}
        digest = gathered_digest(model, self.contributes)
        pending = (
            step,
            final,
            tmp,
            digest,
            {"train": {"step": step, "samples": samples, **self.info, **(extra or {})}},
        )
        writer = dcp.FileSystemWriter(str(tmp))
        try:  # DCP raises the same error on every rank
            if self.async_save:
                self.pending = (dcp.async_save(state, storage_writer=writer, process_group=self.async_group), pending)
                self.blocked = time.perf_counter() - self.started
                return
            dcp.save(state, storage_writer=writer)
        except (Exception, CheckpointException) as e:
            self._finish(pending, _describe(e))
            return
        self._finish(pending, None)

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
        if self.pending is None:
            return
        fut, pending = self.pending
        self.pending = None
        error = None
        try:
            fut.result()
        except (Exception, CheckpointException) as e:
            error = _describe(e)
        self._finish(pending, error)

    def _finish(self, pending: tuple, error: str | None) -> None:
        step, final, tmp, digest, manifest_extra = pending
        self._maybe_kill(step)
        if self.rank == 0 and error is None:
            try:
                written = store.write_manifest(
                    tmp, cfg=self.model_cfg, digest=digest, step=step, layout=self.layout, extra=manifest_extra
                )
                store.commit(tmp, final)
            except (OSError, FourdError) as e:
                error = _describe(e)
        error = self._broadcast(error)
        if error is not None:
            kept = "see rank 0"
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                previous = next((p for _, p in _complete(self.root)), None)
                error += f" ({_storage_state(self.root)})"
                kept = (
                    f"the newest complete checkpoint, {previous.name}, is intact"
                    if previous
                    else "there is no earlier checkpoint"
                )
            raise FourdError(
                f"checkpoint step-{step} was not saved: {error}; {kept}; "
                f"free space under {self.root} (or lower checkpoint.keep) and run again to resume"
            )
        if self.rank == 0:
            size = sum(f["bytes"] for f in written["files"].values()) / 1e6
            took = time.perf_counter() - self.started
            how = f"{took:.2f} s"
            if self.blocked is not None:
                how = f"asynchronous: committed {took:.2f} s after it began, training waited {self.blocked:.2f} s"
            print(f"fourd: checkpoint {final} saved (step {step}, {size:.1f} MB, {how})", flush=True)
            for _step, path in _complete(self.root)[self.keep :]:
                shutil.rmtree(path, ignore_errors=True)

    def _maybe_kill(self, step: int) -> None:
        rank, _, at = os.environ.get(KILL_IN_SAVE_ENV, "").partition("@")
        if self.attempt == 0 and at and int(rank) == self.rank and int(at) == step:
            os.kill(os.getpid(), signal.SIGKILL)

    # resuming ----------------------------------------------------------------------------------
    def resume(self) -> tuple[int, int] | None:
        """Load the newest checkpoint that verifies; (step, samples), or None to start afresh."""
        choice: str | FourdError | None = None
        if self.rank == 0:
            try:
                found = self._choose() if self.root.is_dir() else None
                choice = None if found is None else str(found)
            except FourdError as e:
                choice = e
        choice = self._broadcast(choice)
        if isinstance(choice, FourdError):
            raise choice
        if choice is None:
            return None
        directory = Path(choice)
        reader = SafeReader(str(directory))
        saved = reader.read_metadata().state_dict_metadata
        model, optim, msd, osd = self._state()
        rng_key = f"rng_rank{self.rank}"
        manifest = store.read_manifest(directory)
        same_layout = manifest["layout"] == self.layout
        train = {"step": torch.zeros((), dtype=torch.int64), "samples": torch.zeros((), dtype=torch.int64)}
        if same_layout and f"train.{rng_key}" in saved:
            train[rng_key] = torch.get_rng_state()
        missing = sorted(f"model.{k}" for k in model if f"model.{k}" not in saved)
        if missing:
            raise FourdError(
                f"{directory}: has no tensor {missing[0]} ({len(missing)} missing): it holds another model"
            )
        dcp.load({"model": model, "optim": optim, "train": train}, storage_reader=reader)
        self._restore(model, optim, msd, osd)
        if rng_key in train:
            torch.set_rng_state(train[rng_key])
        step, samples = int(train["step"]), int(train["samples"])
        if self.rank == 0:
            where = "" if same_layout else f" (saved at layout {manifest['layout']}, resharded to {self.layout})"
            after = f" after restart {self.attempt}" if self.attempt else ""
            print(
                f"fourd: resuming{after} from checkpoint {directory} at step {step}, sample {samples}{where}",
                flush=True,
            )
        return step, samples

    def _restore(self, model: dict, optim: dict, msd: dict, osd: dict) -> None:
        """Loaded canonical names back to the prefixed names the module and optimizer know."""
        prefixed = {k.split(".", 1)[1]: k for k in msd}
        optim_sd = {
            f"state.{prefixed[k.removeprefix('state.').rsplit('.', 1)[0]]}.{k.rsplit('.', 1)[1]}": v
            for k, v in optim.items()
        }
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict={prefixed[k]: v for k, v in model.items()},
            optim_state_dict={**osd, **optim_sd},
            options=self.options,
        )

    def _choose(self) -> Path | None:
        """Rank 0: the newest checkpoint that verifies; partial and damaged ones are set aside loudly."""
        for partial in sorted(self.root.glob(".step-*.partial")):
            store.warn(f"ignoring the incomplete checkpoint {partial} (a save was interrupted); removing it")
            shutil.rmtree(partial, ignore_errors=True)

        def set_aside(path: Path, e: FourdError) -> None:
            aside, n = path.with_name(f"{path.name}.damaged"), 1
            while aside.exists():
                n += 1
                aside = path.with_name(f"{path.name}.damaged{n}")
            path.rename(aside)
            store.warn(f"checkpoint {path.name} is damaged ({e}); moved it to {aside.name}")

        path = store.newest(self.run_dir, check=store.verify, on_damaged=set_aside)
        if path is not None:
            store.check_model(path, self.model_cfg)
        return path


def _complete(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the checkpoints whose manifest reads, newest first."""
    out = []
    for step, p in store.checkpoints(root.parent):
        try:
            store.read_manifest(p)
        except FourdError:
            continue
        out.append((step, p))
    return out


def _storage_state(root: Path) -> str:
    """What a failed write may have run into: a full file system or a file-size limit."""
    state = [f"{shutil.disk_usage(root).free / 2**30:.2f} GiB free there"]
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        state.append(f"a file-size limit of {soft:,} bytes (ulimit -f)")
    return ", ".join(state)


def _describe(e: BaseException) -> str:
    """One line for an error that may be DCP's wrapper around the failures of several ranks."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, _trace) = min(e.failures.items())
        return f"rank {rank}: {_describe(inner)}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f" ({e.filename})" if e.filename else "")
    return f"{type(e).__name__}: {e}".splitlines()[0]
