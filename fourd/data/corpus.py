"""Files as fourd reads them: regular files only (never a FIFO, device or /proc file), and the
default corpus, the running interpreter's standard library (no download)."""

from __future__ import annotations

import os
import stat
import sysconfig
from pathlib import Path

from fourd.errors import FourdError


def stdlib_files() -> list[Path]:
    """Every .py file of the standard library (its test suite included), site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )


def read_regular(path: str | os.PathLike, what: str, fix: str) -> bytes:
    """The bytes of a regular file; a FIFO, device, socket or pseudo-file is refused without
    blocking."""
    not_regular = (
        f"{what} {str(path)!r} is not a regular file (a FIFO, device, socket or system file): {fix}"
    )
    try:
        # Checked before opening: opening a FIFO waits for a writer.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise FourdError(not_regular)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(size + 1)
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or e
        raise FourdError(f"{what} {str(path)!r} cannot be read ({reason}): {fix}") from None
    if len(data) > size:  # it reads past its size: a /proc or /sys file
        raise FourdError(not_regular)
    return data
