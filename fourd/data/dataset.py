"""Token streams in a memory-mapped cache, and training samples addressed by a global sample index.

Sample i of a run is a window of seq_len + 1 tokens. The training part of the stream (all but the
held-out tail) is cut into non-overlapping windows; epoch e = i // windows visits them in the order
of a permutation drawn from (seed, e). So the data a step sees depends on the seed and the config
only, never on the layout or the number of ranks: step t trains on samples [t·B, (t+1)·B).
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


@dataclass(frozen=True)
class TokenCache:
    path: Path
    tokens: int
    vocab_size: int
    dtype: str
    source: str

    def array(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.tokens,))


def _token_dtype(vocab: int) -> str:
    return "uint8" if vocab <= 256 else "uint16" if vocab <= 65536 else "uint32"


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
    root.mkdir(parents=True, exist_ok=True)
    bin_path, meta_path = root / f"tokens-{key}.bin", root / f"tokens-{key}.json"
    if meta_path.is_file() and bin_path.is_file():
        meta = json.loads(meta_path.read_text())
        if bin_path.stat().st_size == meta["tokens"] * np.dtype(meta["dtype"]).itemsize:
            return TokenCache(bin_path, meta["tokens"], meta["vocab_size"], meta["dtype"], source)
    dtype = _token_dtype(tok.vocab_size)
    if tok.name == "byte":
        arr = np.frombuffer(SEPARATOR.join(docs).encode("utf-8"), dtype=np.uint8)
    else:
        sep = tok.encode(SEPARATOR)
        ids: list[int] = []
        for i, d in enumerate(docs):
            if i:
                ids.extend(sep)
            ids.extend(tok.encode(d))
        arr = np.asarray(ids, dtype=dtype)
    # Written under temporary names and renamed: a crash never leaves a cache that looks complete.
    tmp = root / f".tokens-{key}.{os.getpid()}.tmp"
    arr.astype(dtype).tofile(tmp)
    os.replace(tmp, bin_path)
    meta = {
        "tokens": int(arr.size),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "tokenizer": tok.identity(),
        "source": source,
    }
    tmp_meta = root / f".tokens-{key}.{os.getpid()}.json.tmp"
    tmp_meta.write_text(json.dumps(meta))
    os.replace(tmp_meta, meta_path)
    return TokenCache(bin_path, int(arr.size), tok.vocab_size, dtype, source)


class SampleStream:
    """Samples by global index from the training part of a token cache; `holdout()` is the rest."""

    def __init__(self, cache: TokenCache, seq_len: int, seed: int, holdout_fraction: float = 0.01):
        self.tokens = cache.array()
        self.seq_len, self.seed = seq_len, seed
        self.train_tokens = int(cache.tokens * (1 - holdout_fraction))
        self.windows = (self.train_tokens - 1) // seq_len
        if self.windows < 1:
            raise FourdError(
                f"the corpus has {cache.tokens} tokens, too few for one sequence of {seq_len}: "
                "give more text or a smaller data.seq_len"
            )
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
