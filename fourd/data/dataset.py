"""Token streams in a memory-mapped cache, and training samples addressed by a global sample index.

Sample i is a window of seq_len + 1 tokens from the training part of the stream (all but the held-out
tail), cut into non-overlapping windows; epoch e = i // windows visits them in a permutation drawn
from (seed, e). Step t trains on samples [t·B, (t+1)·B) whatever the layout (docs/parallelism.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fourd.config import fourd_home
from fourd.data.corpus import SEPARATOR, read_documents
from fourd.data.tokenizer import load_tokenizer
from fourd.errors import FourdError

_DTYPES = ("uint8", "uint16", "uint32")


@dataclass(frozen=True)
class TokenCache:
    path: Path
    tokens: int
    vocab_size: int
    dtype: str
    source: str

    def array(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.tokens,))


def _cached(bin_path: Path, meta_path: Path, source: str) -> TokenCache | None:
    """The cache entry, or None when it is missing or does not describe its file (it is then rebuilt)."""
    try:
        meta = json.loads(meta_path.read_bytes())
        tokens, vocab, dtype = meta["tokens"], meta["vocab_size"], meta["dtype"]
        ok = dtype in _DTYPES and isinstance(tokens, int) and isinstance(vocab, int)
        ok = ok and bin_path.stat().st_size == tokens * np.dtype(dtype).itemsize
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return TokenCache(bin_path, tokens, vocab, dtype, source) if ok else None


def _encode(tok, docs: list[str], dtype: str) -> np.ndarray:
    if tok.name == "byte":
        return np.frombuffer(SEPARATOR.join(docs).encode("utf-8"), dtype=np.uint8)
    sep, ids = tok.encode(SEPARATOR), list[int]()
    for i, d in enumerate(docs):
        ids += (sep if i else []) + tok.encode(d)
    return np.asarray(ids, dtype=dtype)


def prepare(data_path: str, tokenizer_spec: str, cache_dir: str = "") -> TokenCache:
    """Tokenize a corpus once; later calls with the same content find the cache and return at once."""
    tok = load_tokenizer(tokenizer_spec)
    docs, source = read_documents(data_path)
    digest = hashlib.sha256(tok.identity().encode())
    for d in docs:
        b = d.encode("utf-8")
        digest.update(len(b).to_bytes(8, "little"))
        digest.update(b)
    key = digest.hexdigest()[:24]
    root = Path(cache_dir).expanduser() if cache_dir else fourd_home() / "cache"
    bin_path, meta_path = root / f"tokens-{key}.bin", root / f"tokens-{key}.json"
    found = _cached(bin_path, meta_path, source)
    if found is not None:
        return found
    dtype = (
        _DTYPES[0]
        if tok.vocab_size <= 256
        else _DTYPES[1]
        if tok.vocab_size <= 65536
        else _DTYPES[2]
    )
    arr = _encode(tok, docs, dtype)
    meta = {
        "tokens": int(arr.size),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "tokenizer": tok.identity(),
    }
    # Written under temporary names and renamed: a crash never leaves a cache that looks complete.
    tmp = root / f".tokens-{key}.{os.getpid()}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        arr.astype(dtype).tofile(tmp)
        os.replace(tmp, bin_path)
        tmp.with_suffix(".json").write_text(json.dumps({**meta, "source": source}))
        os.replace(tmp.with_suffix(".json"), meta_path)
    except OSError as e:
        where = "data.cache_dir" if cache_dir else "the default cache under $FOURD_HOME"
        raise FourdError(
            f"{where} {str(root)!r} cannot hold the token cache ({e.strerror or e}): give a writable folder"
        ) from None
    return TokenCache(bin_path, int(arr.size), tok.vocab_size, dtype, source)


def split(tokens: int, seq_len: int, holdout_fraction: float) -> tuple[int, int]:
    """(training tokens, training windows) of a stream; refused when not one sequence fits."""
    if not 0 <= holdout_fraction < 0.5:
        raise FourdError(f"data.holdout_fraction = {holdout_fraction} must be in [0, 0.5)")
    train_tokens = int(tokens * (1 - holdout_fraction))
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


class SampleStream:
    """Samples by global index from the training part of a token cache; `holdout()` is the rest."""

    def __init__(self, cache: TokenCache, seq_len: int, seed: int, holdout_fraction: float = 0.01):
        self.tokens = cache.array()
        self.seq_len, self.seed = seq_len, seed
        self.train_tokens, self.windows = split(cache.tokens, seq_len, holdout_fraction)
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return self._perm

    def sample(self, index: int) -> np.ndarray:
        epoch, j = divmod(index, self.windows)
        start = int(self._order(epoch)[j]) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def samples(self, first: int, count: int) -> np.ndarray:
        """[count, seq_len + 1] token ids of samples first .. first + count − 1."""
        return np.stack([self.sample(first + k) for k in range(count)])

    def holdout(self) -> np.ndarray:
        return np.asarray(self.tokens[self.train_tokens :], dtype=np.int64)
