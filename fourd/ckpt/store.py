"""Checkpoint storage: a directory of torch.distributed.checkpoint (DCP) files and a manifest.

    step-100/
      manifest.json      format, version, step, layout, model (ModelConfig), model_digest,
                         files {relative path: {bytes, sha256}}; written last
      .metadata          DCP's index of the tensors (a pickle: see the trust boundary below)
      __0_0.distcp ...   DCP's data files

A checkpoint is written into a staging sibling (`staging_dir`), its files fsynced, the manifest
written last, and the staging directory renamed into place, so a reader sees either no checkpoint
or a complete one. `model_digest` hashes the full (unsharded) tensors, so two layouts that save the
same weights give the same digest.

Trust boundary: DCP's `.metadata` is a Python pickle. `load_model_checkpoint` refuses a directory whose
manifest is missing or whose files do not match the manifest's hashes, and then unpickles `.metadata`
with dcp_io's SafeReader, which builds only DCP's metadata classes. The manifest is not signed: the
hashes catch damage, not someone who can write the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fourd.errors import FourdError
from fourd.model.config import ModelConfig

FORMAT = "fourd-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # a DTensor: gather its shards
    return (full_tensor() if full_tensor is not None else t).detach().cpu().contiguous()


def model_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor in sorted-name order: name, dtype, shape, then the raw bytes.

    DTensors are gathered with `.full_tensor()`, a collective: under a process group every rank
    must call this together. The fields are NUL-separated so that no two different tensors hash alike.
    """
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = _full(state_dict[name])
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # hosts are little-endian
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(final_dir: str | os.PathLike) -> Path:
    """The temporary sibling a checkpoint is written into; the same name on every rank."""
    final = Path(final_dir)
    return final.parent / f".{final.name}.partial"


def write_manifest(
    directory: str | os.PathLike,
    *,
    cfg: ModelConfig,
    digest: str,
    step: int = 0,
    layout: str = "dp=1",
    extra: dict | None = None,
) -> dict:
    """Hash every file already in `directory` and write manifest.json; call it after the last data file."""
    directory = Path(directory)
    files = {
        p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256_file(p)}
        for p in _data_files(directory)
    }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "layout": str(layout),
        "model": cfg.to_dict(),
        "model_digest": digest,
        **(extra or {}),
        "files": files,
    }
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def commit(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> Path:
    """fsync every file of `tmp_dir`, then rename it to `final_dir` in one step."""
    tmp, final = Path(tmp_dir), Path(final_dir)
    if not (tmp / MANIFEST).is_file():
        raise FourdError(f"{tmp}: no {MANIFEST}; write_manifest must run before commit")
    if final.exists():
        raise FourdError(f"{final} already exists; remove it or choose another destination")
    for p in _data_files(tmp):
        _fsync(p)
    for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda p: -len(p.parts)):
        _fsync(d)
    os.rename(tmp, final)
    _fsync(final.parent)
    return final


def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FourdError(f"{directory}: no {MANIFEST}; not a fourd checkpoint (or an incomplete one)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FourdError(f"{path}: not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FourdError(f"{path}: format is not {FORMAT!r}; not a fourd checkpoint")
    if manifest.get("version") != VERSION:
        raise FourdError(f"{path}: version {manifest.get('version')!r} is not supported (this fourd reads {VERSION})")
    for key in ("step", "layout", "model", "model_digest", "files"):
        if key not in manifest:
            raise FourdError(f"{path}: missing field {key!r}; the checkpoint is damaged")
    return manifest


def verify(directory: str | os.PathLike) -> dict:
    """Check every file against the manifest; FourdError names the first missing or altered file."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if not manifest["files"]:
        raise FourdError(f"{directory}/{MANIFEST} lists no files; the checkpoint is damaged")
    for rel, want in sorted(manifest["files"].items()):
        path = directory / rel
        if not path.is_file():
            raise FourdError(f"{path}: missing (listed in {MANIFEST}); the checkpoint is incomplete")
        if path.stat().st_size != want["bytes"]:
            raise FourdError(f"{path}: {path.stat().st_size} bytes, manifest says {want['bytes']}; the file is damaged")
        if _sha256_file(path) != want["sha256"]:
            raise FourdError(f"{path}: SHA-256 differs from {MANIFEST}; the file is damaged")
    return manifest


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint `run_dir/checkpoints/step-<N>` (one whose manifest reads), or None."""
    found = []
    for d in Path(run_dir, "checkpoints").glob("step-*"):
        step = d.name.removeprefix("step-")
        if step.isdigit() and (d / MANIFEST).is_file():
            try:
                read_manifest(d)
            except FourdError:
                continue
            found.append((int(step), d))
    return max(found)[1] if found else None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory standing for its newest complete checkpoint."""
    path = Path(path)
    if (path / MANIFEST).is_file() or not (path / "checkpoints").is_dir():
        return path
    newest = latest(path)
    if newest is None:
        raise FourdError(f"{path}: a run directory without a complete checkpoint under checkpoints/")
    return newest


def _single_process(fn, *args, **kw):
    # DCP warns that it runs without a process group; here that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, no_dist=True, **kw)


def save_model_checkpoint(
    directory: str | os.PathLike,
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    step: int = 0,
    layout: str = "dp=1",
    extra: dict | None = None,
) -> Path:
    """One process, full tensors: the checkpoint `fourd convert` writes and tests build."""
    final = Path(directory)
    if final.exists():
        raise FourdError(f"{final} already exists; remove it or choose another destination")
    tmp = staging_dir(final)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed earlier attempt
    tmp.mkdir(parents=True)
    try:
        sd = {k: _full(v) for k, v in state_dict.items()}
        _single_process(dcp.save, {"model": sd}, storage_writer=dcp.FileSystemWriter(str(tmp)))
        write_manifest(tmp, cfg=cfg, digest=model_digest(sd), step=step, layout=layout, extra=extra)
        return commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_model_checkpoint(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Verify, then load the full model state_dict on the CPU, whatever layout saved it."""
    from fourd.ckpt.dcp_io import SafeReader  # imports this module: a local import avoids the cycle

    directory = Path(directory)
    manifest = verify(directory)
    try:
        cfg = ModelConfig(**manifest["model"])
    except TypeError as e:
        raise FourdError(f"{directory}/{MANIFEST}: field 'model' is not a model config ({e})") from None
    reader = SafeReader(str(directory))
    sd = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            sd[key.removeprefix("model.")] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not sd:
        raise FourdError(f"{directory}: holds no model tensors")
    _single_process(dcp.load, {"model": sd}, storage_reader=reader)
    if model_digest(sd) != manifest["model_digest"]:
        raise FourdError(
            f"{directory}: model_digest of the loaded tensors differs from {MANIFEST}; the checkpoint is damaged"
        )
    return cfg, sd
