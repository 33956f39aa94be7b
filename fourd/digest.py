"""The SHA-256 of a file, as checkpoints and prepared datasets record each of their files."""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK_BYTES = 8 << 20  # read 8 MiB at a time: a shard of gigabytes never sits in memory whole


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of the file's bytes (FIPS 180-4), read block by block."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()
