"""Tokenizers: byte-level (ids are the UTF-8 bytes), or a local Hugging Face `tokenizer.json` or
tiktoken BPE file (docs/hf.md); their libraries are optional and imported only when such a file is
used."""

from __future__ import annotations

import base64
import hashlib
import importlib
import os

import numpy as np

from fourd.data.corpus import read_regular
from fourd.errors import FourdError


class ByteTokenizer:
    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str], threads: int = 0) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def special_token(self) -> tuple[str, int] | None:
        return None  # every id is a byte

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def identity(self) -> str:
        return "byte"


def load_tokenizer(spec: str):
    """ "byte", or a local file: a Hugging Face tokenizer.json (a JSON object) or else a tiktoken
    BPE file."""
    if spec in ("", "byte"):
        return ByteTokenizer()
    raw = read_regular(
        spec, "tokenizer", "give 'byte' or the path of a tokenizer.json or tiktoken BPE file"
    )
    return HFTokenizer(spec, raw) if raw.lstrip()[:1] == b"{" else TiktokenTokenizer(spec, raw)


# Llama 3's pre-tokenization pattern and special-token count, from Meta's released tokenizer (llama3
# repository, tokenizer.py): 256 special tokens follow the BPE ranks, the first two being begin and
# end of text.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL = 256
# End-of-document tokens by the names tokenizers give them (GPT-2 and most BPE files, Megatron's,
# Llama 3's, Llama 2's and T5's, Gemma's), looked up in this order.
END_OF_DOCUMENT = ("<|endoftext|>", "<|eod|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]")


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise FourdError(
            f"reading this tokenizer file needs the {module!r} package: pip install 'fourd[hf]'"
        ) from None


class HFTokenizer:
    """A Hugging Face tokenizer.json; no special tokens are added on encode."""

    name = "tokenizer.json"

    def __init__(self, path: str, raw: bytes):
        tokenizers = _require("tokenizers")
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises a plain Exception for malformed files
            raise FourdError(
                f"{path}: not a valid Hugging Face tokenizer.json ({str(e)[:80]})"
            ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.raw, self._identity = raw, f"hf:{hashlib.sha256(raw).hexdigest()}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], threads: int = 0) -> list[np.ndarray]:
        """The library's batch encoding on all cores (its thread pool; `threads` is set through
        RAYON_NUM_THREADS before the first batch). encode_batch_fast skips the character offsets."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.asarray(e.ids, dtype=np.int64) for e in encode(texts, add_special_tokens=False)]

    def special_token(self) -> tuple[str, int] | None:
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return next(((name, vocab[name]) for name in END_OF_DOCUMENT if name in vocab), None)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def identity(self) -> str:
        return self._identity


class TiktokenTokenizer:
    """A tiktoken BPE file (one `base64-token rank` per line) with Llama 3's pattern and special
    tokens."""

    name = "tiktoken"

    def __init__(self, path: str, raw: bytes):
        tiktoken = _require("tiktoken")
        ranks = read_bpe_ranks(path, raw)
        n = len(ranks)
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
        specials += [f"<|reserved_special_token_{i}|>" for i in range(LLAMA3_SPECIAL - 2)]
        special = {s: n + i for i, s in enumerate(specials)}
        self._enc = tiktoken.Encoding(
            name="bpe", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        self.vocab_size = n + LLAMA3_SPECIAL
        self.raw, self._identity = (
            raw,
            f"tiktoken:{hashlib.sha256(raw).hexdigest()}",
        )  # raw: the file's bytes

    def encode(self, text: str) -> list[int]:
        # Special-token text in the input is encoded as ordinary text, never as control tokens.
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def encode_batch(self, texts: list[str], threads: int = 0) -> list[np.ndarray]:
        """tiktoken's batch encoding: a thread per core, the GIL released while it encodes."""
        batch = self._enc.encode_ordinary_batch(texts, num_threads=threads or os.cpu_count() or 1)
        return [np.asarray(ids, dtype=np.int64) for ids in batch]

    def special_token(self) -> tuple[str, int] | None:
        return "<|end_of_text|>", self.vocab_size - LLAMA3_SPECIAL + 1

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def identity(self) -> str:
        return self._identity


def read_bpe_ranks(path: str, raw: bytes) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise FourdError(
                f"{path}:{n}: not a tiktoken BPE line ('<base64 token> <rank>')"
            ) from None
    if not ranks:
        raise FourdError(f"{path}: no BPE ranks; not a tiktoken BPE file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise FourdError(
            f"{path}: ranks are not 0..{len(ranks) - 1} each once; the file is damaged"
        )
    missing = next((b for b in range(256) if bytes([b]) not in ranks), None)
    if missing is not None:  # tiktoken would abort on a text holding that byte
        raise FourdError(
            f"{path}: byte {missing} has no rank; a tiktoken BPE file ranks all 256 single bytes"
        )
    return ranks
