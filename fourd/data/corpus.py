"""Corpora: the running interpreter's standard library (the default, no download), a text file, a folder
of text files, or JSONL with a "text" field. Documents are joined by a blank line."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from fourd.errors import FourdError

SEPARATOR = "\n\n"


def stdlib_files() -> list[Path]:
    """Every .py file of the standard library (its test suite included), site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _read_text(path: Path, strict: bool) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            raise FourdError(
                f"data file {str(path)!r} is not UTF-8 text (byte {e.start}): convert it to UTF-8 or leave it out"
            ) from None
        return None
    except OSError as e:
        raise FourdError(f"data file {str(path)!r} cannot be read: {e.strerror}") from None


def _jsonl_docs(path: Path) -> list[str]:
    docs = []
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise FourdError(f"data file {str(path)!r} is not UTF-8 (byte {e.start}): convert it to UTF-8") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise FourdError(
                f'{path}:{n}: not valid JSON ({e.msg}); each line must be an object with a "text" field'
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise FourdError(f'{path}:{n}: no string field "text"; each line must be an object with a "text" field')
        docs.append(obj["text"])
    return docs


def read_documents(path: str) -> tuple[list[str], str]:
    """The documents of a corpus, and a short description of where they came from."""
    docs: list
    if not path:
        files = stdlib_files()
        # A few stdlib test files are deliberately not UTF-8; the default corpus skips them.
        docs = [t for t in (_read_text(f, strict=False) for f in files) if t]
        return docs, f"Python standard library ({len(docs)} files)"
    p = Path(path).expanduser()
    if not p.exists():
        raise FourdError(
            f"data path {path!r} does not exist: give a text file, a folder of text files or a .jsonl file"
        )
    if p.is_dir():
        files = sorted(
            f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        docs = []
        for f in files:
            docs.extend(_jsonl_docs(f) if f.suffix == ".jsonl" else [_read_text(f, strict=True)])
        where = f"{path} ({len(files)} files)"
    elif p.suffix == ".jsonl":
        docs = _jsonl_docs(p)
        where = f"{path} ({len(docs)} documents)"
    else:
        docs = [_read_text(p, strict=True)]
        where = path
    texts = [d for d in docs if d]
    if not texts:
        raise FourdError(f"data path {path!r} holds no text: give a non-empty text file, folder or .jsonl file")
    return texts, where
