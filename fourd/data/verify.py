"""A prepared dataset's manifest, read and checked; its shards checked against it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fourd.data.prepare import FORMAT, VERSION
from fourd.digest import sha256_file
from fourd.errors import FourdError
from fourd.manifest import read_manifest_json


def read_manifest(folder: str) -> dict:
    """The dataset's manifest.json, checked for its format and version."""
    return read_manifest_json(
        folder,
        format_name=FORMAT,
        version=VERSION,
        what="a prepared dataset",
        remedy="prepare it again with `fourd data prepare`",
    )


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
