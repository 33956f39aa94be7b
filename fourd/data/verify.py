"""A prepared dataset's manifest, read and checked; its shards checked against it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fourd.data.prepare import FORMAT, MANIFEST, VERSION
from fourd.digest import sha256_file
from fourd.errors import FourdError


def read_manifest(folder: str) -> dict:
    path = Path(folder).expanduser() / MANIFEST
    if not path.is_file():
        raise FourdError(
            f"{folder}: no {MANIFEST}; not a prepared dataset (or an unfinished one): "
            "run `fourd data prepare` to finish it"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FourdError(f"{path}: not valid JSON ({str(e)[:60]}); prepare it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FourdError(f"{path}: format is not {FORMAT!r}; not a fourd prepared dataset")
    if manifest.get("version") != VERSION:
        raise FourdError(
            f"{path}: version {manifest.get('version')!r} is not supported (this fourd reads "
            f"{VERSION}): prepare it again"
        )
    return manifest


def verify(folder: str) -> dict:
    """The manifest when every shard and index has its recorded size and SHA-256; else the first
    mismatch as one FourdError."""
    manifest = read_manifest(folder)
    root = Path(folder).expanduser()
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for shard in manifest["shards"]:
        expected = (
            (shard["file"], shard["tokens"] * itemsize, shard["sha256"]),
            (shard["index"], shard["documents"] * 8, shard["index_sha256"]),
        )
        for name, size, digest in expected:
            path = root / name
            if not path.is_file():
                raise FourdError(f"{path}: missing; prepare the dataset again")
            if path.stat().st_size != size:
                raise FourdError(
                    f"{path}: {path.stat().st_size:,} bytes, the manifest says {size:,}: "
                    "the file is damaged; prepare the dataset again"
                )
            if sha256_file(path) != digest:
                raise FourdError(
                    f"{path}: its SHA-256 differs from the manifest's: the file is damaged; "
                    "prepare the dataset again"
                )
    return manifest
