"""Corpora: the running interpreter's standard library (the default, no download), a text file, a folder
of text files, or JSONL with a "text" field. Documents are joined by a blank line."""

from __future__ import annotations

import json
import os
import stat
import sysconfig
from pathlib import Path

from fourd.errors import FourdError

SEPARATOR = "\n\n"
_FIX = "give a text file, a folder of text files or a .jsonl file"
_PSEUDO = ("proc", "sys", "dev")  # kernel file systems: their files have no fixed content or size


def stdlib_files() -> list[Path]:
    """Every .py file of the standard library (its test suite included), site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )


def read_regular(path: str | os.PathLike, what: str, fix: str) -> bytes:
    """The bytes of a regular file; a FIFO, device, socket or pseudo-file is refused without blocking."""
    not_regular = (
        f"{what} {str(path)!r} is not a regular file (a FIFO, device, socket or system file): {fix}"
    )
    try:
        if not stat.S_ISREG(
            os.stat(path).st_mode
        ):  # checked before opening: opening a FIFO waits for a writer
            raise FourdError(not_regular)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(size + 1)
    except (OSError, ValueError) as e:
        raise FourdError(
            f"{what} {str(path)!r} cannot be read ({getattr(e, 'strerror', None) or e}): {fix}"
        ) from None
    if len(data) > size:  # it reads past its size: a /proc or /sys file
        raise FourdError(not_regular)
    return data


def _text(path: Path, strict: bool) -> str | None:
    try:
        return read_regular(path, "data file", _FIX).decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            raise FourdError(
                f"data file {str(path)!r} is not UTF-8 text (byte {e.start}): convert it to UTF-8 or leave it out"
            ) from None
        return None


def _jsonl_docs(path: Path) -> list[str]:
    docs = []
    for n, line in enumerate((_text(path, strict=True) or "").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise FourdError(
                f'{path}:{n}: not valid JSON ({str(e)[:60]}); each line must be an object with a "text" field'
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise FourdError(
                f'{path}:{n}: no string field "text"; each line must be an object with a "text" field'
            )
        docs.append(obj["text"])
    return docs


def _docs(p: Path) -> list[str]:
    return _jsonl_docs(p) if p.suffix == ".jsonl" else [_text(p, strict=True) or ""]


def read_documents(path: str) -> tuple[list[str], str]:
    """The documents of a corpus, and a short description of where they came from."""
    if not path:
        # A few stdlib test files are deliberately not UTF-8; the default corpus skips them.
        docs = [t for t in (_text(f, strict=False) for f in stdlib_files()) if t]
        return docs, f"Python standard library ({len(docs)} files)"
    p = Path(path).expanduser()
    if not os.path.lexists(p):
        raise FourdError(f"data path {path!r} does not exist: {_FIX}")
    if os.path.realpath(p).split(os.sep)[1:2] in [[d] for d in _PSEUDO]:
        raise FourdError(f"data path {path!r} lies in a system file system: {_FIX}")
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if not f.is_dir() and not any(s[0] == "." for s in f.relative_to(p).parts)
        )
        docs = [d for f in files for d in _docs(f)]
        where = f"{path} ({len(files)} files)"
    else:
        docs = _docs(p)
        where = f"{path} ({len(docs)} documents)" if p.suffix == ".jsonl" else path
    texts = [d for d in docs if d]
    if not texts:
        raise FourdError(f"data path {path!r} holds no text: {_FIX} that is not empty")
    return texts, where
