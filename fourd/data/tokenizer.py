"""Tokenizers. The default is byte-level: token ids are the UTF-8 bytes (vocabulary 256). Local files: a
Hugging Face `tokenizer.json` (the `tokenizers` library) or a tiktoken-format BPE file such as Llama 3's
`tokenizer.model` (the `tiktoken` library); both libraries are optional (`pip install 'fourd[hf]'`) and
imported only when such a file is used."""

from __future__ import annotations

import base64
import hashlib
import importlib
from pathlib import Path

from fourd.errors import FourdError


class ByteTokenizer:
    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def identity(self) -> str:
        return "byte"


def load_tokenizer(spec: str):
    """ "byte", or a local file: a Hugging Face tokenizer.json or a tiktoken-format BPE file."""
    if spec in ("", "byte"):
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise FourdError(
            f"tokenizer {spec!r}: not 'byte' and not a file; give 'byte' or the path of a "
            "tokenizer.json or tiktoken BPE file"
        )
    return load_tokenizer_file(spec)


# Llama 3's pre-tokenization pattern and special-token count, from Meta's released tokenizer (llama3 repository,
# tokenizer.py): 256 special tokens follow the BPE ranks, the first two being begin and end of text.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL = 256


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise FourdError(f"reading this tokenizer file needs the {module!r} package: pip install 'fourd[hf]'") from None


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class HFTokenizer:
    """A Hugging Face tokenizer.json; no special tokens are added on encode."""

    name = "tokenizer.json"

    def __init__(self, path: Path):
        tokenizers = _require("tokenizers")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a plain Exception for malformed files
            raise FourdError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._identity = f"hf:{_file_sha256(path)}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def identity(self) -> str:
        return self._identity


class TiktokenTokenizer:
    """A tiktoken BPE file (one `base64-token rank` per line) with Llama 3's pattern and special tokens."""

    name = "tiktoken"

    def __init__(self, path: Path):
        tiktoken = _require("tiktoken")
        ranks = read_bpe_ranks(path)
        n = len(ranks)
        specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
            f"<|reserved_special_token_{i}|>" for i in range(LLAMA3_SPECIAL - 2)
        ]
        self._enc = tiktoken.Encoding(
            name=path.name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={s: n + i for i, s in enumerate(specials)},
        )
        self.vocab_size = n + LLAMA3_SPECIAL
        self._identity = f"tiktoken:{_file_sha256(path)}"

    def encode(self, text: str) -> list[int]:
        # Special-token text in the input is encoded as ordinary text, never as control tokens.
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def identity(self) -> str:
        return self._identity


def read_bpe_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise FourdError(f"{path}:{n}: not a tiktoken BPE line ('<base64 token> <rank>')") from None
    if not ranks:
        raise FourdError(f"{path}: no BPE ranks; not a tiktoken BPE file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise FourdError(f"{path}: ranks are not 0..{len(ranks) - 1} each once; the file is damaged")
    return ranks


def load_tokenizer_file(spec: str):
    """A tokenizer.json (a JSON object) or else a tiktoken BPE file, decided by the file's content."""
    path = Path(spec)
    with open(path, "rb") as f:
        looks_json = f.read(4096).lstrip()[:1] == b"{"
    return HFTokenizer(path) if looks_json else TiktokenTokenizer(path)
