"""Checkpoint storage: DCP files and a manifest.json with a typed schema, written atomically (format
and trust boundary: docs/fault-tolerance.md). Only loading and saving tensors imports torch."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from fourd.digest import sha256_file
from fourd.errors import FourdError
from fourd.manifest import MANIFEST, read_manifest_json
from fourd.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

# DCP warns when it runs without a process group; fourd's single-process saves and loads do so on
# purpose.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

FORMAT = "fourd-checkpoint"
VERSION = 1
CHECKPOINTS = "checkpoints"
_SHA = "sha256"  # a kind: 64 lowercase hexadecimal digits
_KINDS = {
    bool: "true or false",
    int: "an integer >= 0",
    float: "a finite number >= 0",
    str: "a string",
    dict: "an object",
    _SHA: "a SHA-256",
}
# The manifest's schema: field -> kind. Keys it does not name are kept, unchecked.
_TOP = {
    "format": str,
    "version": int,
    "step": int,
    "layout": str,
    "model": dict,
    "model_digest": _SHA,
    "files": dict,
}
_TOP |= {"train": dict, "hf_config": dict}
_FILE = {"bytes": int, "sha256": _SHA}
_TRAIN = {
    "step": int,
    "samples": int,
    "seed": int,
    "global_batch": int,
    "steps": int,
    "config": dict,
    "data": dict,
}
_DATA = {"path": str, "tokenizer": str, "identity": str, "source": str, "tokens": int}
_CONFIG_DATA = {
    "path": str,
    "tokenizer": str,
    "seq_len": int,
    "cache_dir": str,
    "holdout_fraction": float,
    "mix": str,
}


def warn(message: str) -> None:
    print(f"fourd: warning: {message}", file=sys.stderr, flush=True)


def _typed(where: str, name: str, value, kind):
    if kind == _SHA:
        valid = (
            isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")
        )
    elif kind is bool:
        valid = isinstance(value, bool)
    elif kind is float:
        valid = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
        )
    else:
        valid = (
            isinstance(value, kind)
            and not isinstance(value, bool)
            and (not isinstance(value, int) or value >= 0)
        )
    if not valid:
        shown = repr(value)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        raise FourdError(
            f"{where}: field {name!r} = {shown} is not {_KINDS[kind]}; the checkpoint is damaged"
        )
    return value


def _check(where: str, prefix: str, obj: dict, spec: dict, required=()) -> None:
    for key in required:
        if key not in obj:
            raise FourdError(f"{where}: missing field {prefix + key!r}; the checkpoint is damaged")
    for key, kind in spec.items():
        if key in obj:
            _typed(where, prefix + key, obj[key], kind)


def model_config(where: str, spec: dict) -> ModelConfig:
    """The ModelConfig a manifest records; any wrong key or type is one FourdError naming the
    field."""
    kinds = {
        field.name: {"int": int, "float": float, "str": str, "bool": bool}[str(field.type)]
        for field in fields(ModelConfig)
    }
    for key, value in spec.items():
        if key not in kinds:
            raise FourdError(
                f"{where}: field 'model.{key}' is not a model setting; the checkpoint is damaged"
            )
        _typed(where, f"model.{key}", value, kinds[key])
    try:
        cfg = ModelConfig(**spec)
    except (TypeError, FourdError) as e:
        raise FourdError(
            f"{where}: field 'model' is not a valid model ({e}); the checkpoint is damaged"
        ) from None
    # the planner's own shapes: fourd trains a Llama (SwiGLU) with its own output projection
    if cfg.mlp != "swiglu":
        raise FourdError(
            f"{where}: model.mlp = {cfg.mlp!r}; a checkpoint holds a Llama (swiglu) model"
        )
    if cfg.tied_embeddings:
        raise FourdError(
            f"{where}: model.tied_embeddings = true; a checkpoint holds fourd's Llama, whose "
            "output projection is its own matrix"
        )
    return cfg


def inside(folder: str | os.PathLike, rel: object, source: str) -> Path:
    """`folder/rel`, refused unless `rel` is a relative path that resolves inside `folder`."""
    root, path = Path(folder).resolve(), None
    if isinstance(rel, str) and rel:
        with contextlib.suppress(OSError, ValueError):
            path = (root / rel).resolve()
    if path is None or path == root or not path.is_relative_to(root):
        raise FourdError(
            f"{source} names {rel!r}, which is not a file inside {folder}; the file "
            "is damaged or forged"
        )
    return path


def read_manifest(directory: str | os.PathLike) -> dict:
    """manifest.json, checked against its schema: any missing or wrong-typed field is one
    FourdError."""
    manifest = read_manifest_json(
        directory,
        format_name=FORMAT,
        version=VERSION,
        what="a fourd checkpoint",
        remedy="use a checkpoint this fourd wrote (`fourd ckpt verify DIR` checks one)",
    )
    path = Path(directory) / MANIFEST
    where = str(path)
    _check(where, "", manifest, _TOP, required=("step", "layout", "model", "model_digest", "files"))
    model_config(where, manifest["model"])
    for rel, entry in manifest["files"].items():
        inside(directory, rel, where)
        _check(
            where,
            f"files[{rel!r}].",
            _typed(where, f"files[{rel!r}]", entry, dict),
            _FILE,
            required=_FILE,
        )
    train = manifest.get("train", {})
    _check(where, "train.", train, _TRAIN)
    _check(where, "train.data.", train.get("data", {}), _DATA)
    config_data = _typed(where, "train.config.data", train.get("config", {}).get("data", {}), dict)
    _check(where, "train.config.data.", config_data, _CONFIG_DATA)
    return manifest


def verify(directory: str | os.PathLike) -> dict:
    """Check every file against the manifest; FourdError names the first missing or altered file."""
    manifest = read_manifest(directory)
    if not manifest["files"]:
        raise FourdError(f"{directory}/{MANIFEST} lists no files; the checkpoint is damaged")
    for rel, want in sorted(manifest["files"].items()):
        path = Path(directory) / rel
        if not os.path.isfile(path):
            raise FourdError(
                f"{path}: missing (listed in {MANIFEST}); the checkpoint is incomplete"
            )
        if path.stat().st_size != want["bytes"]:
            raise FourdError(
                f"{path}: {path.stat().st_size} bytes, manifest says "
                f"{want['bytes']}; the file is damaged"
            )
        if sha256_file(path) != want["sha256"]:
            raise FourdError(f"{path}: SHA-256 differs from {MANIFEST}; the file is damaged")
    return manifest


def checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, dir) of every `run_dir/checkpoints/step-<N>`, newest first, complete or not."""
    found = Path(run_dir, CHECKPOINTS).glob("step-*")
    return sorted(
        ((int(path.name[5:]), path) for path in found if path.name[5:].isdecimal()), reverse=True
    )


def newest(run_dir: str | os.PathLike, check=read_manifest, on_damaged=None) -> Path | None:
    """The newest checkpoint passing `check`; says in one line which damaged newer ones it
    skipped. `on_damaged(path, error)` may act on each (set it aside) and return what it did, for
    that line."""
    skipped: list[str] = []
    actions: list[str] = []
    found: Path | None = None
    for _step, path in checkpoints(run_dir):
        try:
            check(path)
            found = path
            break
        except FourdError as e:
            skipped.append(path.name)
            done = on_damaged(path, e) if on_damaged is not None else None
            if done:
                actions.append(f"checkpoint {path.name} is damaged ({e}); {done}")
    if found:
        fallback = f"falling back to the previous complete checkpoint {found.name}"
    else:
        fallback = "no complete checkpoint is left"
    if actions:
        warn("; ".join(actions) + f"; {fallback}")
    elif skipped and found:
        warn(f"{fallback} (skipped damaged {', '.join(skipped)})")
    elif skipped:
        warn(f"skipped damaged {', '.join(skipped)}")
    return found


def check_model(directory: str | os.PathLike, cfg: ModelConfig) -> None:
    """Refuse a checkpoint of another model than `cfg`, naming the settings that differ (a setting
    a manifest of an older fourd lacks reads as its default)."""
    where = str(directory)
    saved = model_config(where, read_manifest(directory)["model"]).to_dict()
    wanted = cfg.to_dict()
    diff = ", ".join(
        f"{k} {saved.get(k)} (this run: {value})"
        for k, value in wanted.items()
        if saved.get(k) != value
    )
    if diff:
        raise FourdError(
            f"{directory} holds another model: {diff}; use another run directory or the same model"
        )


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory standing for its newest complete checkpoint."""
    path = Path(path)
    if (path / MANIFEST).is_file() or not (path / CHECKPOINTS).is_dir():
        return path
    found = newest(path)
    if found is None:
        raise FourdError(
            f"{path}: a run directory without a complete checkpoint under {CHECKPOINTS}/"
        )
    return found


def _fsync(path: Path) -> None:
    handle = os.open(path, os.O_RDONLY)
    os.fsync(handle)
    os.close(handle)


def staging_dir(final_dir: str | os.PathLike) -> Path:
    """The temporary sibling a checkpoint is written into; the same name on every rank."""
    return Path(final_dir).with_name(f".{Path(final_dir).name}.partial")


def write_manifest(
    directory, cfg: ModelConfig, digest: str, step: int = 0, layout: str = "dp=1", extra=None
) -> dict:
    """Hash every file already in `directory` and write manifest.json; call it after the last data
    file."""
    directory = Path(directory)
    data = sorted(path for path in directory.rglob("*") if path.is_file() and path.name != MANIFEST)
    files = {
        path.relative_to(directory).as_posix(): {
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        }
        for path in data
    }
    top = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "layout": str(layout),
        "model": cfg.to_dict(),
    }
    manifest = {**top, "model_digest": digest, **(extra or {}), "files": files}
    with open(directory / MANIFEST, "w") as file:
        json.dump(manifest, file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    return manifest


def commit(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> Path:
    """fsync every file of `tmp_dir`, then rename it to `final_dir` in one step."""
    tmp, final = Path(tmp_dir), Path(final_dir)
    if final.exists():
        raise FourdError(f"{final} already exists; remove it or choose another destination")
    for path in sorted(tmp.rglob("*"), key=lambda path: -len(path.parts)) + [tmp]:
        _fsync(path)
    os.rename(tmp, final)
    _fsync(final.parent)
    return final


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole tensor; a DTensor gathers its shards (a collective)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    if full_tensor is not None:
        tensor = full_tensor()
    return tensor.detach().cpu().contiguous()


def model_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order: name, dtype, shape (NUL-separated), raw bytes;
    DTensors are gathered (a collective: every rank calls it)."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = full(state_dict[name])
        digest.update(
            f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0".encode()
        )
        digest.update(
            tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        )  # hosts are little-endian
    return digest.hexdigest()


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of `cfg`'s model and its shape (built on the meta device: no memory)."""
    from fourd.model.llama import build_model

    return {
        k: tuple(value.shape) for k, value in build_model(cfg, device="meta").state_dict().items()
    }


@contextlib.contextmanager
def staged(final: str | os.PathLike) -> Iterator[Path]:
    """A fresh staging directory for `final` (which must not exist), removed again if the block
    fails."""
    if Path(final).exists():
        raise FourdError(f"{final} already exists; remove it or choose another destination")
    tmp = staging_dir(final)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed earlier attempt
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_model_checkpoint(
    directory, cfg: ModelConfig, state_dict, step: int = 0, layout="dp=1", extra=None
) -> Path:
    """One process, full tensors: the checkpoint `fourd convert` writes and tests build."""
    import torch.distributed.checkpoint as dcp

    with staged(directory) as tmp:
        state = {k: full(tensor) for k, tensor in state_dict.items()}
        dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
        write_manifest(
            tmp, cfg=cfg, digest=model_digest(state), step=step, layout=layout, extra=extra
        )
        return commit(tmp, directory)


def load_model_checkpoint(
    directory: str | os.PathLike,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Verify, then load the full model state_dict on the CPU, whatever layout saved it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fourd.ckpt.safe_reader import SafeReader

    manifest = verify(directory)
    cfg = model_config(str(directory), manifest["model"])
    reader = SafeReader(str(directory))
    state = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            state[key.removeprefix("model.")] = torch.empty(meta.size, dtype=meta.properties.dtype)
    held = sum(tensor.numel() for tensor in state.values())
    if held != cfg.params():  # checked before any model of cfg's size is built
        raise FourdError(
            f"{directory}: holds {held:,} model parameters, its manifest's model "
            f"has {cfg.params():,}"
        )
    want = shapes(cfg)
    bad = sorted(set(want) ^ set(state)) or sorted(
        k for k in state if tuple(state[k].shape) != want[k]
    )
    if bad:
        raise FourdError(
            f"{directory}: tensor {bad[0]} does not fit its manifest's model "
            "(names or shapes differ)"
        )
    dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    if model_digest(state) != manifest["model_digest"]:
        raise FourdError(
            f"{directory}: the loaded tensors' model_digest differs from {MANIFEST}; it is damaged"
        )
    return cfg, state
