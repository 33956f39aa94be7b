"""Sources of documents, read as a stream of batches: memory is bounded by a batch, not by the
corpus.

A source is one file: a text file (one document), JSONL (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one
document per line, its text in a field), a Parquet file (one document per row), or an Arrow file of
a Hugging Face `datasets` folder written by `save_to_disk` (read with pyarrow; `datasets` is not
needed). A folder expands into its files in sorted order, hidden ones left out. Each source's
SHA-256 is computed while it streams (Parquet and Arrow, which are read by seeking, in one
sequential pass of their bytes).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fourd.data.corpus import read_regular, stdlib_files
from fourd.digest import sha256_file
from fourd.errors import FourdError

FIX = "give a text file, a folder of text files or a .jsonl file"
_PSEUDO = ("proc", "sys", "dev")  # kernel file systems: their files have no fixed content or size
# A batch holds at most this many documents or (about) this many bytes of text, whichever comes
# first.
BATCH_DOCUMENTS = 1024
BATCH_BYTES = 16 << 20
_CHUNK = 8 << 20  # bytes read at a time when decompressing


@dataclass(frozen=True)
class Source:
    """One file of a corpus and what identifies its content cheaply (size, modification time)."""

    path: str
    kind: str  # text, jsonl, jsonl.gz, jsonl.zst, parquet, arrow
    size: int
    mtime_ns: int

    def fingerprint(self) -> dict:
        return {"path": self.path, "kind": self.kind, "size": self.size, "mtime_ns": self.mtime_ns}


def _kind(path: Path) -> str:
    name = path.name.lower()
    for suffix in (".jsonl.gz", ".jsonl.zst", ".jsonl", ".parquet", ".arrow"):
        if name.endswith(suffix):
            return suffix[1:]
    return "text"


def _source(path: Path, kind: str = "") -> Source:
    info = os.stat(path)
    return Source(str(path.resolve()), kind or _kind(path), info.st_size, info.st_mtime_ns)


def _hf_arrow_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a `save_to_disk` folder in its own order, or None when it is not one.

    A Dataset folder holds state.json listing its `_data_files`; a DatasetDict folder holds
    dataset_dict.json listing its splits, each a Dataset folder."""
    splits = folder / "dataset_dict.json"
    if splits.is_file():
        names = json.loads(splits.read_text()).get("splits", [])
        found = [_hf_arrow_files(folder / name) or [] for name in names]
        return [f for files in found for f in files]
    state = folder / "state.json"
    if not state.is_file():
        return None
    files = json.loads(state.read_text()).get("_data_files", [])
    return [folder / entry["filename"] for entry in files]


def list_sources(paths: list[str]) -> list[Source]:
    """Every source file under `paths`, in order; a missing path or a system file is refused."""
    sources: list[Source] = []
    for given in paths:
        path = Path(given).expanduser()
        if not os.path.lexists(path):
            raise FourdError(f"data path {given!r} does not exist: {FIX}")
        if os.path.realpath(path).split(os.sep)[1:2] in [[d] for d in _PSEUDO]:
            raise FourdError(f"data path {given!r} lies in a system file system: {FIX}")
        if not path.is_dir():
            sources.append(_source(path))
            continue
        arrow = _hf_arrow_files(path)
        if arrow is not None:
            sources += [_source(f, "arrow") for f in arrow]
            continue
        inside = sorted(
            f
            for f in path.rglob("*")
            if not f.is_dir() and not any(part[0] == "." for part in f.relative_to(path).parts)
        )
        sources += [_source(f) for f in inside]
    return sources


def stdlib_sources() -> list[Source]:
    """The default corpus: the running interpreter's standard library, one document per file."""
    return [_source(f, "text") for f in stdlib_files()]


class _HashingReader:
    """A binary file whose bytes feed a SHA-256 as they are read."""

    def __init__(self, path: str):
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        self.sha256 = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        self.sha256.update(data)
        return data

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._file.close()


def _require(module: str, why: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise FourdError(f"{why} needs the {module!r} package: pip install 'fourd[data]'") from None


def _lines(reader: _HashingReader, kind: str) -> Iterator[bytes]:
    """The lines of a JSONL file, decompressed as they stream."""
    if kind == "jsonl.gz":
        stream = gzip.GzipFile(fileobj=reader, mode="rb")  # type: ignore[call-overload]
    elif kind == "jsonl.zst":
        zstandard = _require("zstandard", "reading .jsonl.zst")
        stream = zstandard.ZstdDecompressor().stream_reader(reader)
    else:
        stream = reader
    rest = b""
    while True:
        chunk = stream.read(_CHUNK)
        if not chunk:
            break
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def _not_utf8(where: str, error: UnicodeDecodeError) -> FourdError:
    return FourdError(
        f"data file {where!r} is not UTF-8 text (byte {error.start}): "
        "convert it to UTF-8 or leave it out"
    )


def _jsonl_documents(source: Source, field: str, reader: _HashingReader) -> Iterator[str]:
    fix = f'each line must be an object with a "{field}" field'
    try:
        for number, raw in enumerate(_lines(reader, source.kind), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise FourdError(
                    f"{source.path}:{number}: not UTF-8 (byte {e.start}); convert it to UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise FourdError(
                    f"{source.path}:{number}: not valid JSON ({str(e)[:60]}); {fix}"
                ) from None
            if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                raise FourdError(f'{source.path}:{number}: no string field "{field}"; {fix}')
            yield obj[field]
    except (OSError, EOFError) as e:  # a damaged .gz or .zst stream
        raise FourdError(
            f"{source.path}: cannot be decompressed ({e}): the file is damaged"
        ) from None


def _column_documents(source: Source, field: str) -> Iterator[str]:
    """The `field` column of a Parquet file (row group by row group) or of an Arrow stream file."""
    pa = _require("pyarrow", "reading Parquet and Arrow files")
    try:
        if source.kind == "parquet":
            parquet = importlib.import_module("pyarrow.parquet")
            table = parquet.ParquetFile(source.path)
            names = table.schema_arrow.names
            batches = table.iter_batches(batch_size=BATCH_DOCUMENTS, columns=[field])
        else:
            reader = pa.ipc.open_stream(pa.memory_map(source.path))
            names = reader.schema.names
            batches = iter(reader)
        if field not in names:
            raise FourdError(
                f'{source.path}: no column "{field}" (it has {", ".join(names)}): '
                "give --text-field with the column that holds the text"
            )
        for batch in batches:
            column = batch.column(names.index(field) if source.kind == "arrow" else 0)
            if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
                raise FourdError(
                    f'{source.path}: column "{field}" holds {column.type}, not text: '
                    "give --text-field with the column that holds the text"
                )
            yield from (text for text in column.to_pylist() if text is not None)
    except (pa.ArrowException, OSError) as e:
        kind = "Parquet" if source.kind == "parquet" else "Arrow"
        raise FourdError(
            f"{source.path}: not a readable {kind} file ({str(e)[:80]}): "
            "check the file or leave it out"
        ) from None


class DocumentReader:
    """The documents of one source, and its SHA-256 once they have all been read."""

    def __init__(self, source: Source, field: str = "text", skip_non_utf8: bool = False):
        self.source, self.field, self.skip_non_utf8 = source, field, skip_non_utf8
        self.sha256 = ""

    def documents(self) -> Iterator[str]:
        """Each non-empty document in order; `sha256` is set when the iterator is exhausted."""
        kind = self.source.kind
        if kind in ("parquet", "arrow"):
            refuse_irregular(self.source.path)
            yield from (d for d in _column_documents(self.source, self.field) if d)
            self.sha256 = sha256_file(Path(self.source.path))
            return
        if kind == "text":
            raw = read_regular(self.source.path, "data file", FIX)
            self.sha256 = hashlib.sha256(raw).hexdigest()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if self.skip_non_utf8:
                    return
                raise _not_utf8(self.source.path, e) from None
            if text:
                yield text
            return
        refuse_irregular(self.source.path)
        reader = _HashingReader(self.source.path)
        try:
            yield from (d for d in _jsonl_documents(self.source, self.field, reader) if d)
        finally:
            reader.close()
        self.sha256 = reader.sha256.hexdigest()

    def batches(self, skip: int = 0) -> Iterator[list[str]]:
        """The documents after the first `skip`, in batches of at most BATCH_DOCUMENTS documents or
        about BATCH_BYTES characters."""
        batch: list[str] = []
        size = 0
        for number, text in enumerate(self.documents()):
            if number < skip:
                continue
            batch.append(text)
            size += len(text)
            if len(batch) >= BATCH_DOCUMENTS or size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


def refuse_irregular(path: str) -> None:
    """Refuse a FIFO, device or socket before opening it (opening a FIFO waits for a writer)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise FourdError(
            f"data file {path!r} is not a regular file (a FIFO, device, socket or system file): "
            f"{FIX}"
        )
