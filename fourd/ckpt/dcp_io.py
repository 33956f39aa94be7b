"""Checkpoints of a running job: sharded save, resume at any layout, retention, the model digest.

    RUN/checkpoints/step-8/     manifest.json + DCP files (one data file per rank, .metadata)
    RUN/checkpoints/.step-12.partial   a save in progress (or one a crash interrupted: ignored)

What a checkpoint holds (DCP state keys, every value a tensor):
    model.<name>                       the parameters under their canonical (single-model) names
    optim.state.<name>.<exp_avg|...>   AdamW's state per parameter, same names
    train.step, train.samples          the last finished step and the global index of the next sample
    train.rng_rank<R>                  rank R's torch RNG state (restored only at the same world size)
Canonical names make DCP reshard on load: a checkpoint saved at tp=2,pp=2,dp=2 loads at dp=4.
Optimizer hyperparameters (lr, betas, weight decay) are not stored: they come from the run's config
and the LR schedule is a function of the step.

Saving, on every rank: DCP writes the data files into the staging directory; the model digest is
computed (a collective); rank 0 hashes the files into the manifest, fsyncs, renames the staging
directory into place, then deletes all but the newest `keep` complete checkpoints. Any failure
(a full disk, say) removes the staging directory and raises on every rank; the older checkpoints
are untouched.

Trust: before anything is read, rank 0 checks every file against the manifest's SHA-256 sums. DCP's
`.metadata` is a pickle; it is read with an unpickler that only builds DCP's own metadata classes
and torch dtypes/sizes, and the data files are read with `torch.load(weights_only=True)` by DCP. A
checkpoint therefore never runs code of its own; the manifest is not signed, so the sums only
protect against damage, not against someone who can write the directory.
"""

from __future__ import annotations

import os
import pickle
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fourd.ckpt import store
from fourd.errors import FourdError
from fourd.model.config import ModelConfig

CHECKPOINTS = "checkpoints"
# Fault injection for tests and demos: "RANK@STEP" SIGKILLs RANK during the save at STEP, after the
# data files are written and before the manifest is (first attempt only, like --fault.kill-rank).
KILL_IN_SAVE_ENV = "FOURD_FAULT_KILL_IN_SAVE"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir, CHECKPOINTS, f"step-{step}")


def warn(message: str) -> None:
    print(f"fourd: warning: {message}", file=sys.stderr, flush=True)


# --- reading DCP metadata without running code -------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("torch.serialization", "_get_layout"),
}  # the last looks a layout up by name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type):  # DCP's metadata dataclasses and enums, nothing callable else
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose `.metadata` unpickling can only build DCP's metadata classes."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
            raise FourdError(f"{path}: refused ({e}); load only checkpoints fourd wrote") from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --- the model digest across pipeline ranks ------------------------------------------------------


def gathered_digest(model_sd: dict[str, torch.Tensor], contributes: bool) -> str | None:
    """store.model_digest of the whole model when each rank holds a part of it (collective).

    Every rank gathers its stage's full tensors (DTensor.full_tensor: collectives inside the stage's
    TP and dp×cp groups, which all hold the same names); one rank per pipeline stage (`contributes`)
    sends them to rank 0, which hashes them in canonical order. Rank 0 thus holds one full copy of the
    model in CPU memory: fine for the models this trainer runs on CPUs and single nodes, not for 405B.
    Returns the digest on rank 0, None elsewhere.
    """
    full = {name: store._full(model_sd[name]) for name in sorted(model_sd)}
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


# --- the job's checkpointer ---------------------------------------------------------------------


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
        self.root = self.run_dir / CHECKPOINTS
        # Stage modules under "0.", "1." ... so that one optimizer over all of them maps to names;
        # the prefix is stripped to the canonical name before saving.
        self.module = nn.ModuleDict({str(i): s for i, s in enumerate(stages)})
        self.optimizer = optimizer
        self.model_cfg = model_cfg
        self.layout = layout
        self.contributes = contributes
        self.keep = keep
        self.attempt = attempt
        self.info = info or {}
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)
        # async_save writes from a background thread: it gets its own gloo group so that its
        # collectives never interleave with the training step's.
        self.async_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self.async_save = async_save
        self.pending: tuple | None = None  # (future, final dir, staging dir, step, digest, manifest extra)

    # state dicts under canonical names ----------------------------------------------------------
    def _state(self) -> tuple[dict, dict, dict, dict]:
        msd, osd = get_state_dict(self.module, self.optimizer, options=self.options)
        model = {k.split(".", 1)[1]: v for k, v in msd.items()}
        optim = {
            "state." + k.removeprefix("state.").split(".", 1)[1]: v for k, v in osd.items() if k.startswith("state.")
        }
        return model, optim, msd, osd

    def _train_state(self, step: int, samples: int) -> dict:
        return {
            "step": torch.tensor(step, dtype=torch.int64),
            "samples": torch.tensor(samples, dtype=torch.int64),
            f"rng_rank{self.rank}": torch.get_rng_state(),
        }

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
        self._barrier()
        model, optim, _, _ = self._state()
        state = {"model": model, "optim": optim, "train": self._train_state(step, samples)}
        digest = gathered_digest(model, self.contributes)
        manifest_extra = {"train": {"step": step, "samples": samples, **self.info, **(extra or {})}}
        if self.async_save:
            try:
                fut = dcp.async_save(
                    state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=self.async_group
                )
            except (Exception, CheckpointException) as e:  # staging failed: report like a failed write
                self._finish(step, final, tmp, digest, manifest_extra, f"{type(e).__name__}: {e}")
                return
            self.pending = (fut, final, tmp, step, digest, manifest_extra)
            self.blocked = time.perf_counter() - self.started
            return
        error = None
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))
        except (Exception, CheckpointException) as e:  # DCP raises the same error on every rank
            error = _describe(e)
        self._finish(step, final, tmp, digest, manifest_extra, error)

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
        fut, final, tmp, step, digest, manifest_extra = self.pending
        self.pending = None
        error = None
        try:
            fut.result()
        except (Exception, CheckpointException) as e:
            error = _describe(e)
        self._finish(step, final, tmp, digest, manifest_extra, error)

    def _finish(self, step, final, tmp, digest, manifest_extra, error) -> None:
        self._maybe_kill(step)
        if self.rank == 0 and error is None:
            try:
                written = store.write_manifest(
                    tmp, cfg=self.model_cfg, digest=digest, step=step, layout=self.layout, extra=manifest_extra
                )
                if final.exists():  # a damaged one that resume set aside would have been renamed
                    raise FourdError(f"{final} already exists")
                store.commit(tmp, final)
            except (OSError, FourdError) as e:
                error = _describe(e)
        if self.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                previous = store.latest(self.run_dir)
                error += f" ({_storage_state(self.root)})"
                kept = (
                    f"the newest complete checkpoint, {previous.name}, is intact"
                    if previous
                    else "there is no earlier checkpoint"
                )
            else:
                kept = "see rank 0"
            raise FourdError(
                f"checkpoint step-{step} was not saved: {error}; {kept}; "
                f"free space under {self.root} (or lower checkpoint.keep) and run again to resume"
            )
        if self.rank == 0:
            size = sum(f["bytes"] for f in written["files"].values()) / 1e6
            took = time.perf_counter() - self.started
            how = (
                f"{took:.2f} s"
                if self.blocked is None
                else f"asynchronous: committed {took:.2f} s after it began, training waited {self.blocked:.2f} s"
            )
            print(f"fourd: checkpoint {final} saved (step {step}, {size:.1f} MB, {how})", flush=True)
            self._retain()

    def _maybe_kill(self, step: int) -> None:
        spec = os.environ.get(KILL_IN_SAVE_ENV, "")
        if self.attempt == 0 and spec:
            rank, _, at = spec.partition("@")
            if int(rank) == self.rank and int(at) == step:
                os.kill(os.getpid(), signal.SIGKILL)

    def _retain(self) -> None:
        complete = sorted(_complete(self.root))
        for _step, path in complete[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # resuming ----------------------------------------------------------------------------------
    def resume(self) -> tuple[int, int] | None:
        """Load the newest checkpoint that verifies; (step, samples), or None to start afresh."""
        choice: str | FourdError | None = None
        if self.rank == 0:
            try:
                choice = str(self._choose()) if self.root.is_dir() else None
            except FourdError as e:
                choice = e
        if self.world > 1:
            box = [choice]
            dist.broadcast_object_list(box, src=0)
            choice = box[0]
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
                f"{directory}: has no tensor {missing[0]} (and {len(missing) - 1} more): "
                "it was saved from another model; use another --run-dir"
            )
        dcp.load({"model": model, "optim": optim, "train": train}, storage_reader=reader)
        # back to the prefixed names the module and optimizer know
        prefixed = {k.split(".", 1)[1]: k for k in msd}
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict={prefixed[k]: v for k, v in model.items()},
            optim_state_dict={
                **osd,
                **{
                    "state." + prefixed[k.removeprefix("state.").rsplit(".", 1)[0]] + "." + k.rsplit(".", 1)[1]: v
                    for k, v in optim.items()
                },
            },
            options=self.options,
        )
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

    def _choose(self) -> Path | None:
        """Rank 0: the newest checkpoint that verifies; damaged and partial ones are set aside loudly."""
        for partial in sorted(self.root.glob(".step-*.partial")):
            warn(
                f"ignoring the incomplete checkpoint {partial} (a save was interrupted before its manifest "
                "was written); removing it"
            )
            shutil.rmtree(partial, ignore_errors=True)
        candidates = sorted(
            ((int(p.name[5:]), p) for p in self.root.glob("step-*") if p.name[5:].isdigit()), reverse=True
        )
        skipped = []
        for _step, path in candidates:
            try:
                manifest = store.verify(path)
            except FourdError as e:
                aside = _free_name(path.with_name(f"{path.name}.damaged"))
                path.rename(aside)
                warn(f"checkpoint {path.name} is damaged ({e}); moved it to {aside.name}")
                skipped.append(path.name)
                continue
            if manifest["model"] != self.model_cfg.to_dict():
                raise FourdError(
                    f"{path} holds another model ({manifest['model']}); this run asks for "
                    f"{self.model_cfg.to_dict()}: use another --run-dir"
                )
            if skipped:
                warn(
                    f"falling back to the previous complete checkpoint {path.name} "
                    f"(skipped damaged {', '.join(skipped)})"
                )
            return path
        if skipped:
            warn(f"no complete checkpoint left in {self.root}; starting from step 0")
        return None


def _complete(root: Path) -> list[tuple[int, Path]]:
    out = []
    for p in root.glob("step-*"):
        if p.name[5:].isdigit():
            try:
                store.read_manifest(p)
            except FourdError:
                continue
            out.append((int(p.name[5:]), p))
    return out


def _free_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}{n}")
    return candidate


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
