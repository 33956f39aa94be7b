"""Prepare a corpus once: stream its documents, tokenize them in batches on all cores, write token
shards.

A prepared folder holds `shard-NNNNN.bin` (the token ids, raw little-endian uint16 when the
vocabulary fits, else uint32), `shard-NNNNN.idx` (uint64: where each document of the shard ends, its
end-of-document ids included) and `manifest.json`, written last (docs/data.md). Every document is
followed by the end-of-document ids; the stream a trainer reads ends before the last document's.

The work happens in a hidden sibling folder renamed into place at the end, so a folder with a
manifest is always complete. After each shard the folder records where the next one starts; an
interrupted prepare continues from there.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fourd.data.sources import DocumentReader, Source
from fourd.data.tokenizer import load_tokenizer
from fourd.errors import FourdError, plural
from fourd.manifest import MANIFEST

FORMAT = "fourd-tokens"
VERSION = 1
PROGRESS = "progress.json"
SHARD_TOKENS = 1 << 28  # a shard closes at the first document end past 268M tokens (512 MiB uint16)
BLANK_LINE = "\n\n"


@dataclass(frozen=True)
class Request:
    """What to prepare: the sources and how their documents become tokens."""

    sources: tuple[Source, ...]
    tokenizer: str
    label: str  # the paths as the user gave them, for messages
    text_field: str = "text"
    eod_id: int | None = None
    holdout_fraction: float = 0.01
    skip_non_utf8: bool = (
        False  # the default corpus only: a few standard-library files are not UTF-8
    )
    shard_tokens: int = SHARD_TOKENS
    workers: int = 0  # tokenizer threads; 0: every core

    def key(self, identity: str) -> dict:
        """Everything the prepared tokens depend on: a resumed or a repeated prepare must match
        it."""
        return {
            "sources": [s.fingerprint() for s in self.sources],
            "tokenizer": identity,
            "text_field": self.text_field,
            "eod_id": self.eod_id,
            "shard_tokens": self.shard_tokens,
        }


def end_of_document(tok, eod_id: int | None) -> dict:
    """The ids that follow every document: --eod-id when given, else the tokenizer's own
    end-of-document token, else the tokens of a blank line (what byte-level fourd has always
    used)."""
    if eod_id is not None:
        if not 0 <= eod_id < 2**32:
            raise FourdError(f"--eod-id {eod_id} must be in 0 .. 2^32 - 1")
        return {"ids": [eod_id], "text": "", "from": "--eod-id"}
    special = tok.special_token()
    if special is not None:
        return {"ids": [special[1]], "text": special[0], "from": "the tokenizer's own token"}
    return {"ids": tok.encode(BLANK_LINE), "text": BLANK_LINE, "from": "a blank line"}


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_json(path: Path, obj: dict) -> None:
    """Written under a temporary name and renamed: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class _Shard:
    """The shard being written: tokens appended batch by batch, hashed as they are written."""

    def __init__(self, folder: Path, number: int, dtype: str):
        self.name = f"shard-{number:05d}"
        self.dtype = dtype
        self.tokens_file = open(folder / f"{self.name}.bin", "wb")  # noqa: SIM115
        self.index_file = open(folder / f"{self.name}.idx", "wb")  # noqa: SIM115
        self.tokens_sha, self.index_sha = hashlib.sha256(), hashlib.sha256()
        self.tokens = self.documents = 0

    def add(self, documents: list[np.ndarray], eod: np.ndarray) -> int:
        """Append documents, each followed by `eod`; the number of tokens written."""
        lengths = np.fromiter((d.size + eod.size for d in documents), np.uint64, len(documents))
        pieces = [piece for d in documents for piece in (d, eod)]
        data = np.concatenate(pieces).astype(f"<{np.dtype(self.dtype).str[1:]}").tobytes()
        ends = (self.tokens + np.cumsum(lengths, dtype=np.uint64)).astype("<u8").tobytes()
        self.tokens_file.write(data)
        self.index_file.write(ends)
        self.tokens_sha.update(data)
        self.index_sha.update(ends)
        written = int(lengths.sum())
        self.tokens += written
        self.documents += len(documents)
        return written

    def close(self) -> dict:
        for f in (self.tokens_file, self.index_file):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return {
            "file": f"{self.name}.bin",
            "index": f"{self.name}.idx",
            "tokens": self.tokens,
            "documents": self.documents,
            "sha256": self.tokens_sha.hexdigest(),
            "index_sha256": self.index_sha.hexdigest(),
        }


def _prefetched(batches: Iterator[list[str]]) -> Iterator[list[str]]:
    """The batches read one ahead on a thread: parsing the next batch overlaps tokenizing this
    one."""
    ahead: queue.Queue = queue.Queue(maxsize=2)
    done = object()

    def read() -> None:
        try:
            for batch in batches:
                ahead.put(batch)
            ahead.put(done)
        except BaseException as e:  # handed to the consumer, which raises it
            ahead.put(e)

    threading.Thread(target=read, daemon=True).start()
    while (item := ahead.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


class _Progress:
    """A tqdm bar on a terminal (stderr); elsewhere a plain line every 10 seconds, on stdout for
    `fourd data prepare` and on stderr for the token cache `fourd train` builds (whose first stdout
    line names the run). The closing line of `fourd data prepare` goes to stdout either way: bad
    input stays the one line on stderr."""

    def __init__(self, total_bytes: int, label: str, stream=None):
        self.total, self.label, self.done, self.tokens = total_bytes, label, 0, 0
        self.stream = stream or sys.stdout
        self.start = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=label, leave=False)

    def advance(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(nbytes)
        elif time.monotonic() - self.last >= 10:
            self.last = time.monotonic()
            print(self.line(), file=self.stream, flush=True)

    def line(self) -> str:
        seconds = time.monotonic() - self.start
        return (
            f"{self.label}: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB, "
            f"{plural(self.tokens, 'token')}, {seconds:.0f} s"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _State:
    """Where a prepare stands: the shards and sources done, and the position in the current
    source."""

    def __init__(self, key: dict):
        self.key = key
        self.shards: list[dict] = []
        self.sources: list[dict] = []
        self.position = {"source": 0, "documents": 0, "tokens": 0}

    def save(self, folder: Path) -> None:
        state = {"key": self.key, "shards": self.shards, "sources": self.sources}
        write_json(folder / PROGRESS, {**state, "position": self.position})

    @classmethod
    def resume(cls, folder: Path, key: dict) -> _State:
        """The saved state of an interrupted prepare of the same request, or a fresh one."""
        state = cls(key)
        try:
            saved = json.loads((folder / PROGRESS).read_text())
        except (OSError, ValueError):
            return state
        if saved.get("key") != key:
            return state
        state.shards, state.sources, state.position = (
            saved["shards"],
            saved["sources"],
            saved["position"],
        )
        return state


def _tokenize(
    request: Request, folder: Path, state: _State, tok, eod: dict, dtype: str, cache_entry: bool
) -> None:
    """Stream every source from the saved position on, closing a shard at the first document end at
    or past shard_tokens (whatever the batches) and saving the position after it."""
    eod_ids = np.asarray(eod["ids"], dtype=np.int64)
    shard = _Shard(folder, len(state.shards), dtype)
    progress = _Progress(
        sum(s.size for s in request.sources),
        f"fourd data prepare {folder.name.removeprefix('.').split('.partial')[0]}",
        stream=sys.stderr if cache_entry else sys.stdout,
    )
    progress.advance(sum(s["size"] for s in state.sources), 0)
    first = state.position["source"]
    for number in range(first, len(request.sources)):
        source = request.sources[number]
        reader = DocumentReader(source, request.text_field, request.skip_non_utf8)
        credited = 0  # of the source's bytes, shown as done: its characters read so far, at most
        for batch in _prefetched(reader.batches(state.position["documents"])):
            encoded = tok.encode_batch(batch, request.workers)
            ends = np.cumsum([ids.size + eod_ids.size for ids in encoded])
            done = 0  # documents of the batch written
            while done < len(encoded):
                room = request.shard_tokens - shard.tokens + (ends[done - 1] if done else 0)
                take = min(int(np.searchsorted(ends, room, side="left")) + 1, len(encoded)) - done
                written = shard.add(encoded[done : done + take], eod_ids)
                done += take
                state.position["documents"] += take
                state.position["tokens"] += written
                if shard.tokens >= request.shard_tokens:
                    state.shards.append(shard.close())
                    state.save(folder)
                    shard = _Shard(folder, len(state.shards), dtype)
            share = min(sum(len(text) for text in batch), source.size - credited)
            credited += share
            progress.advance(share, int(ends[-1]))
        record = source.fingerprint() | {"sha256": reader.sha256}
        record |= {"documents": state.position["documents"], "tokens": state.position["tokens"]}
        state.sources.append(record)
        state.position = {"source": number + 1, "documents": 0, "tokens": 0}
        progress.advance(source.size - credited, 0)
    if shard.documents or not state.shards:
        state.shards.append(shard.close())
    else:  # the last batch closed a shard: this one stayed empty
        shard.close()
        for suffix in (".bin", ".idx"):
            (folder / f"{shard.name}{suffix}").unlink()
    progress.close()
    if not cache_entry:
        print(progress.line(), flush=True)


def prepare_into(
    request: Request,
    out: Path,
    description: str = "",
    *,
    allow_empty: bool = False,
    cache_entry: bool = False,
) -> dict:
    """Prepare `request` into the folder `out` (or find it there, done); its manifest. A task's
    share (`allow_empty`) may hold no text. A cache entry replaces a damaged `out`, and may be
    built by several processes at once (every rank under torchrun): each works in a folder of its
    own, not resumed, and the first to finish wins."""
    if request.workers:
        os.environ["RAYON_NUM_THREADS"] = str(request.workers)  # the tokenizers library's pool
    tok = load_tokenizer(request.tokenizer)
    key = request.key(tok.identity())
    done = _finished(out, key, cache_entry)
    if done is not None:
        return done
    eod = end_of_document(tok, request.eod_id)
    vocab = max(tok.vocab_size, max(eod["ids"]) + 1)
    partial = out.with_name(f".{out.name}.partial")
    if cache_entry:
        partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True, exist_ok=True)
        state = _State.resume(partial, key)
        _tokenize(request, partial, state, tok, eod, dtype_for(vocab), cache_entry)
    except FourdError:  # bad input: nothing is left half written (an interruption keeps its shards)
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except OSError as e:
        raise FourdError(
            f"{out.parent}: cannot hold the prepared dataset ({e.strerror or e}): "
            "give a writable folder"
        ) from None
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "key": key,
        "description": description or ", ".join(s.path for s in request.sources[:3]),
        "tokenizer": {"spec": request.tokenizer, "identity": tok.identity(), "name": tok.name},
        "vocab_size": vocab,
        "dtype": dtype_for(vocab),
        "eod": eod,
        "text_field": request.text_field,
        "sources": state.sources,
        "shards": state.shards,
    }
    manifest |= totals(manifest, request.holdout_fraction, partial)
    if manifest["documents"] == 0 and not allow_empty:
        shutil.rmtree(partial, ignore_errors=True)
        raise FourdError(f"data path {request.label!r} holds no text: {_NO_TEXT_FIX}")
    (partial / PROGRESS).unlink(missing_ok=True)
    write_json(partial / MANIFEST, manifest)
    return _move_into_place(partial, out, key, manifest)


def _move_into_place(partial: Path, out: Path, key: dict, manifest: dict) -> dict:
    """Rename the finished folder to `out`; when another process finished `out` first, keep its."""
    theirs = _finished(out, key, True)
    if theirs is None and out.exists():
        shutil.rmtree(out, ignore_errors=True)  # no manifest: an earlier, unfinished attempt's
    try:
        if theirs is None:
            os.replace(partial, out)
            return manifest
    except OSError:  # another process renamed its folder there between the check and now
        theirs = _finished(out, key, True)
        if theirs is None:
            raise
    shutil.rmtree(partial, ignore_errors=True)
    return theirs


_NO_TEXT_FIX = "give a text file, a folder of text files or a .jsonl file that is not empty"


def _finished(out: Path, key: dict, replaceable: bool) -> dict | None:
    """The manifest of `out` when it holds this request's prepared tokens; a folder holding anything
    else is refused unless `replaceable`."""
    if not out.exists():
        return None
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and manifest.get("key") == key:
        return manifest
    if replaceable or (out.is_dir() and not any(out.iterdir())):
        return None
    raise FourdError(
        f"--out {out} already holds other files (another dataset, or not one): "
        "choose another --out, or remove it"
    )


def totals(manifest: dict, holdout_fraction: float, folder: Path) -> dict:
    """Tokens and documents of the stream, and its held-out split
    (fourd.data.dataset.held_out_start)."""
    from fourd.data.dataset import held_out_start

    stored = sum(s["tokens"] for s in manifest["shards"])
    documents = sum(s["documents"] for s in manifest["shards"])
    tokens = max(stored - len(manifest["eod"]["ids"]), 0)
    starts = document_starts(folder, manifest["shards"])
    first = held_out_start(tokens, holdout_fraction, starts)
    held_documents = documents - int(np.searchsorted(starts, first, side="left"))
    whole = first == tokens or bool(np.isin(first, starts))
    holdout = {"fraction": holdout_fraction, "first_token": first, "tokens": tokens - first}
    holdout |= {"documents": held_documents if whole else 0, "whole_documents": whole}
    return {"tokens": tokens, "documents": documents, "holdout": holdout}


def document_starts(folder: Path, shards: list[dict]) -> np.ndarray:
    """Where every document starts in the stream (uint64), from the shards' indexes."""
    starts = [np.zeros(0, dtype=np.uint64)]
    offset = 0
    for shard in shards:
        ends = np.fromfile(folder / shard["index"], dtype="<u8")
        starts.append(offset + np.concatenate(([0], ends[:-1])).astype(np.uint64))
        offset += shard["tokens"]
    return np.concatenate(starts)
