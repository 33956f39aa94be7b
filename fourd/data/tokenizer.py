"""Tokenizers. The default is byte-level: token ids are the UTF-8 bytes (vocabulary 256)."""

from __future__ import annotations

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
    from fourd.hf.tokenizers import load_tokenizer_file

    return load_tokenizer_file(spec)
