"""The manifest.json that a fourd checkpoint and a prepared dataset both carry: found, parsed and
checked for its format name and version in one place, each problem one FourdError ending in the
remedy."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fourd.errors import FourdError

MANIFEST = "manifest.json"


def read_manifest_json(
    folder: str | os.PathLike, *, format_name: str, version: int, what: str, remedy: str
) -> dict:
    """The parsed manifest of `folder` when it exists, is a JSON object, names `format_name` and
    has `version`; `what` names the kind of folder ("a fourd checkpoint") in the messages."""
    path = Path(folder).expanduser() / MANIFEST
    if not path.is_file():
        raise FourdError(f"{folder}: no {MANIFEST}; not {what} (or an unfinished one): {remedy}")
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as error:
        raise FourdError(f"{path}: not valid JSON ({str(error)[:80]}); {remedy}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != format_name:
        raise FourdError(f"{path}: format is not {format_name!r}; not {what}: {remedy}")
    if manifest.get("version") != version:
        found = manifest.get("version")
        raise FourdError(
            f"{path}: version {found!r} is not supported (this fourd reads {version}): {remedy}"
        )
    return manifest
