"""Prepared token datasets read by memory map, and training samples addressed by a global sample
index.

Sample i is a window of seq_len + 1 tokens from the training part of the stream (all but the
held-out tail), cut into non-overlapping windows; epoch e = i // windows visits them in a
permutation drawn from (seed, e). Step t trains on samples [t·B, (t+1)·B) whatever the layout
(docs/parallelism.md). A mixture draws sample i from one of several datasets by weight, from (seed,
i) alone (docs/data.md).

Opening a prepared folder reads its manifest only; tokens are paged in by the windows that use them.
A raw corpus given to `data.path` is prepared once into $FOURD_HOME/cache (fourd.data.prepare) and
found again from its files' sizes and modification times.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fourd.config import fourd_home
from fourd.data.prepare import MANIFEST, Request, document_starts, prepare_into
from fourd.data.sources import list_sources, stdlib_sources
from fourd.data.tokenizer import load_tokenizer
from fourd.errors import FourdError


@functools.lru_cache(maxsize=256)
def _memmap(path: str, dtype: str, tokens: int) -> np.ndarray:
    if tokens == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=f"<{np.dtype(dtype).str[1:]}", mode="r", shape=(tokens,))


@dataclass(frozen=True)
class TokenDataset:
    """A stream of token ids in one or more shard files (a prepared folder's, or one raw file)."""

    path: Path  # the prepared folder, or the token file itself when `shards` names it
    tokens: int  # the stream's length: the shards' tokens less the last end-of-document ids
    vocab_size: int
    dtype: str
    source: str  # where the documents came from, in words
    identity: str = ""  # the tokenizer's (fourd.data.tokenizer identity())
    tokenizer: str = "byte"  # the tokenizer as given to the prepare: byte or a file's path
    shards: tuple[tuple[str, int], ...] = ()  # (file under path, tokens); () : path is one file
    has_index: bool = False  # whether each shard has its .idx of document ends
    holdout: tuple[float, int] | None = None  # the manifest's (fraction, first held-out token)

    def _files(self) -> list[tuple[str, int]]:
        if not self.shards:
            return [(str(self.path), self.tokens)]
        return [(str(self.path / name), count) for name, count in self.shards]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens start .. stop − 1 of the stream as int64, read across shard boundaries."""
        stop = min(stop, self.tokens)
        pieces, offset = [], 0
        for file, count in self._files():
            if offset < stop and start < offset + count:
                part = _memmap(file, self.dtype, count)
                pieces.append(part[max(start - offset, 0) : stop - offset])
            offset += count
        if not pieces:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(pieces).astype(np.int64)

    def array(self) -> np.ndarray:
        """The whole stream; a memory map when it is one shard (else read into memory)."""
        files = self._files()
        if len(files) == 1:
            return _memmap(files[0][0], self.dtype, files[0][1])[: self.tokens]
        return self.read(0, self.tokens)

    def document_starts(self) -> np.ndarray | None:
        if not self.has_index:
            return None
        shards = [{"index": name[: -len(".bin")] + ".idx", "tokens": n} for name, n in self.shards]
        return document_starts(self.path, shards)

    def held_out_start(self, fraction: float) -> int:
        """The first held-out token: the manifest's when it was prepared with this fraction."""
        if self.holdout is not None and self.holdout[0] == fraction:
            return self.holdout[1]
        return held_out_start(self.tokens, fraction, self.document_starts())

    def split(self, seq_len: int, holdout_fraction: float) -> tuple[int, int]:
        return split(self.tokens, seq_len, holdout_fraction, self.held_out_start)

    def stream(self, seq_len: int, seed: int, holdout_fraction: float) -> SampleStream:
        return SampleStream(self, seq_len, seed, holdout_fraction)


TokenCache = TokenDataset  # the name the trainer and older callers import


def held_out_start(tokens: int, fraction: float, starts: np.ndarray | None) -> int:
    """Where the held-out tail starts: the first document start at or after token ⌊tokens · (1 −
    fraction)⌋, so the tail is whole documents; when no document starts there (the last document is
    longer than the tail, or the stream has no document index), that token itself."""
    point = int(tokens * (1 - fraction))
    if starts is None or len(starts) == 0:
        return point
    found = int(np.searchsorted(starts, point, side="left"))
    if found < len(starts) and int(starts[found]) < tokens:
        return int(starts[found])
    return point


def split(tokens: int, seq_len: int, holdout_fraction: float, start_of=None) -> tuple[int, int]:
    """(training tokens, training windows) of a stream; refused when not one sequence fits.
    `start_of(fraction)` gives the first held-out token (default: ⌊tokens · (1 − fraction)⌋)."""
    if not 0 <= holdout_fraction < 0.5:
        raise FourdError(f"data.holdout_fraction = {holdout_fraction} must be in [0, 0.5)")
    if start_of is None:
        train_tokens = int(tokens * (1 - holdout_fraction))
    else:
        train_tokens = start_of(holdout_fraction)
    windows = (train_tokens - 1) // seq_len
    if windows < 1:
        need = seq_len + 1
        while int(need * (1 - holdout_fraction)) < seq_len + 1:
            need += 1
        raise FourdError(
            f"the corpus has {tokens} tokens, too few for one training sequence: {need} are needed "
            f"(data.seq_len {seq_len} + 1, plus the held-out {holdout_fraction:.0%}); "
            "give more text or a smaller data.seq_len"
        )
    return train_tokens, windows


class TokenSpan:
    """Tokens start .. stop − 1 of a dataset, read as int64 slice by slice (the held-out tail)."""

    def __init__(self, dataset: TokenDataset, start: int, stop: int):
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, part: slice) -> np.ndarray:
        first, last, _ = part.indices(len(self))
        return self.dataset.read(self.start + first, self.start + max(last, first))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[0 : len(self)]
        return whole if dtype is None else whole.astype(dtype)

    def tolist(self) -> list[int]:
        return self[0 : len(self)].tolist()


class SampleStream:
    """Samples by global index from the training part of a dataset; `holdout()` is the rest."""

    def __init__(
        self, cache: TokenDataset, seq_len: int, seed: int, holdout_fraction: float = 0.01
    ):
        self.dataset = cache
        self.seq_len, self.seed = seq_len, seed
        self.train_tokens, self.windows = cache.split(seq_len, holdout_fraction)
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return self._perm

    def sample(self, index: int) -> np.ndarray:
        epoch, j = divmod(index, self.windows)
        start = int(self._order(epoch)[j]) * self.seq_len
        return self.dataset.read(start, start + self.seq_len + 1)

    def samples(self, first: int, count: int) -> np.ndarray:
        """[count, seq_len + 1] token ids of samples first .. first + count − 1."""
        return np.stack([self.sample(first + k) for k in range(count)])

    @property
    def held_out_tokens(self) -> int:
        return self.dataset.tokens - self.train_tokens

    def holdout(self) -> TokenSpan:
        return TokenSpan(self.dataset, self.train_tokens, self.dataset.tokens)


def open_prepared(folder: str | os.PathLike) -> TokenDataset:
    """A prepared folder, from its manifest alone."""
    path = Path(folder).expanduser().resolve()
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        shards = tuple((s["file"], int(s["tokens"])) for s in manifest["shards"])
        holdout = manifest["holdout"]
        return TokenDataset(
            path=path,
            tokens=int(manifest["tokens"]),
            vocab_size=int(manifest["vocab_size"]),
            dtype=manifest["dtype"],
            source=manifest["description"],
            identity=manifest["tokenizer"]["identity"],
            tokenizer=manifest["tokenizer"]["spec"],
            shards=shards,
            has_index=True,
            holdout=(float(holdout["fraction"]), int(holdout["first_token"])),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FourdError(
            f"{path}/{MANIFEST} cannot be read ({e}): the folder is not a complete prepared "
            "dataset; prepare it again with `fourd data prepare`"
        ) from None


def is_prepared(path: str) -> bool:
    return bool(path) and (Path(path).expanduser() / MANIFEST).is_file()


def _unfinished(folder: Path) -> bool:
    """Whether a folder holds what `fourd data prepare` writes before its manifest."""
    marks = ("progress.json", "shard-00000.bin", "task-00000-of-*")
    return any(next(folder.glob(mark), None) is not None for mark in marks)


def prepare(data_path: str, tokenizer_spec: str, cache_dir: str = "") -> TokenDataset:
    """The dataset `data.path` names: a prepared folder as it is; a raw corpus prepared once into
    the cache, found again later from its files' sizes and modification times (no reading of the
    corpus)."""
    if is_prepared(data_path):
        found = open_prepared(data_path)
        if tokenizer_spec not in ("", "byte"):
            identity = load_tokenizer(tokenizer_spec).identity()
            if identity != found.identity:
                raise FourdError(
                    f"data.path {data_path} was prepared with another tokenizer than "
                    f"data.tokenizer {tokenizer_spec}: drop data.tokenizer to use its own"
                )
        return found
    folder = Path(data_path).expanduser()
    if data_path and folder.is_dir() and _unfinished(folder):
        raise FourdError(
            f"data.path {data_path} is an unfinished prepared dataset (no {MANIFEST}): run its "
            "`fourd data prepare` again (or `fourd data merge` after its tasks) to finish it"
        )
    if data_path:
        sources = list_sources([data_path])
        request = Request(sources=tuple(sources), tokenizer=tokenizer_spec, label=data_path)
    else:
        sources = stdlib_sources()
        request = Request(
            sources=tuple(sources), tokenizer=tokenizer_spec, label="", skip_non_utf8=True
        )
    identity = load_tokenizer(tokenizer_spec).identity()
    key = hashlib.sha256(json.dumps(request.key(identity), sort_keys=True).encode()).hexdigest()
    root = Path(cache_dir).expanduser() if cache_dir else fourd_home() / "cache"
    where = "data.cache_dir" if cache_dir else "the default cache under $FOURD_HOME"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FourdError(
            f"{where} {str(root)!r} cannot hold the token cache ({e.strerror or e}): "
            "give a writable folder"
        ) from None
    entry = root / f"data-{key[:24]}"
    if not data_path:
        description = f"Python standard library ({len(sources)} files)"
    elif len(sources) == 1 and sources[0].kind == "text":
        description = data_path
    else:
        description = f"{data_path} ({len(sources)} files)"
    prepare_into(request, entry, description, cache_entry=True)
    return open_prepared(entry)


MIX_BLOCK = 4096  # samples per block of a mixture: each block holds every dataset's exact share


def _mix_items(spec: str) -> list[tuple[str, str]]:
    """`DIR_A=0.7,DIR_B=0.3` as [(DIR_A, "0.7"), (DIR_B, "0.3")]: each weight's text as given."""
    items = []
    for item in spec.split(","):
        path, equals, weight = item.strip().rpartition("=")
        if not equals or not path:
            raise FourdError(
                f"data.mix item {item.strip()!r} is not DIR=WEIGHT: give e.g. data/a=0.7,data/b=0.3"
            )
        items.append((path, weight))
    return items


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """`DIR_A=0.7,DIR_B=0.3` as [(DIR_A, 0.7), (DIR_B, 0.3)]; every weight a positive number."""
    parts = []
    for path, weight in _mix_items(spec):
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise FourdError(
                f"data.mix weight of {path} is {weight!r}, not a positive number: give a weight > 0"
            )
        parts.append((path, value))
    return parts


def absolute_mix(spec: str) -> str:
    """data.mix with every DIR made absolute, its weights' text and the order kept, so that a run's
    recorded data.mix names the same datasets from any working directory (as data.path does)."""
    parse_mix(spec)  # a bad spec is refused in the words it was given
    return ",".join(
        f"{Path(path).expanduser().resolve()}={weight}" for path, weight in _mix_items(spec)
    )


def _block_counts(weights: tuple[float, ...]) -> list[int]:
    """Each dataset's samples in a block of MIX_BLOCK: its share w / Σw of the block, rounded by the
    largest remainder (Hamilton's method), so that the counts sum to MIX_BLOCK."""
    total = sum(weights)
    exact = [MIX_BLOCK * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: counts[k] - exact[k])
    for k in by_remainder[: MIX_BLOCK - sum(counts)]:
        counts[k] += 1
    return counts


@dataclass(frozen=True)
class Mixture:
    """Several prepared datasets drawn by weight; every one read with the same tokenizer."""

    parts: tuple[TokenDataset, ...]
    weights: tuple[float, ...]
    spec: str  # data.mix as given

    @property
    def tokens(self) -> int:
        return sum(part.tokens for part in self.parts)

    @property
    def vocab_size(self) -> int:
        return max(part.vocab_size for part in self.parts)

    @property
    def identity(self) -> str:
        return self.parts[0].identity

    @property
    def tokenizer(self) -> str:
        return self.parts[0].tokenizer

    @property
    def source(self) -> str:
        return "mixture " + ", ".join(
            f"{part.source} {weight:g}" for part, weight in zip(self.parts, self.weights)
        )

    def stream(self, seq_len: int, seed: int, holdout_fraction: float) -> MixtureStream:
        return MixtureStream(self, seq_len, seed, holdout_fraction)


class MixtureStream:
    """Sample i of a mixture: block b = i // MIX_BLOCK holds each dataset's count (_block_counts) in
    an order drawn from (seed, b); the k-th sample of dataset d in block b is that dataset's own
    sample b · count_d + k. Everything follows from (seed, i): any layout, any resume point."""

    def __init__(self, mixture: Mixture, seq_len: int, seed: int, holdout_fraction: float):
        self.streams = [part.stream(seq_len, seed, holdout_fraction) for part in mixture.parts]
        self.counts = _block_counts(mixture.weights)
        self.seed = seed
        self._block, self._owner, self._rank = -1, np.zeros(0, np.int64), np.zeros(0, np.int64)

    def _assign(self, block: int) -> None:
        if block == self._block:
            return
        owners = np.repeat(np.arange(len(self.counts)), self.counts)
        owners = np.random.default_rng([self.seed, block, len(self.counts)]).permutation(owners)
        rank = np.zeros(MIX_BLOCK, dtype=np.int64)
        for part in range(len(self.counts)):
            mine = owners == part
            rank[mine] = np.arange(int(mine.sum()))
        self._block, self._owner, self._rank = block, owners, rank

    def sample(self, index: int) -> np.ndarray:
        block, position = divmod(index, MIX_BLOCK)
        self._assign(block)
        part = int(self._owner[position])
        local = block * self.counts[part] + int(self._rank[position])
        return self.streams[part].sample(local)

    def samples(self, first: int, count: int) -> np.ndarray:
        return np.stack([self.sample(first + k) for k in range(count)])

    @property
    def held_out_tokens(self) -> int:
        return self.streams[0].held_out_tokens

    def holdout(self) -> TokenSpan:
        """A mixture's held-out windows are its first dataset's."""
        return self.streams[0].holdout()


def open_mixture(spec: str, tokenizer_spec: str, cache_dir: str = "") -> Mixture:
    """data.mix: each dataset opened as data.path would be; all must share one tokenizer."""
    pairs = parse_mix(spec)
    parts = tuple(prepare(path, tokenizer_spec, cache_dir) for path, _ in pairs)
    for (path, _), part in zip(pairs, parts):
        if part.identity != parts[0].identity:
            raise FourdError(
                f"data.mix: {path} was tokenized by another tokenizer than {pairs[0][0]}: "
                "prepare every dataset of a mixture with the same tokenizer"
            )
    return Mixture(parts=parts, weights=tuple(w for _, w in pairs), spec=spec)


def open_data(data) -> TokenDataset | Mixture:
    """What the [data] section of a run names: data.mix's mixture, or data.path's dataset."""
    if data.mix and data.path:
        raise FourdError(
            f"data.mix and data.path = {data.path!r} are both set: give one (data.mix names "
            "every dataset of the mixture)"
        )
    if data.mix:
        return open_mixture(data.mix, data.tokenizer, data.cache_dir)
    return prepare(data.path, data.tokenizer, data.cache_dir)
