"""Tokenizers from local files: tokenizer.json and tiktoken BPE, built here with known merges."""

import base64
import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fourd.data.tokenizer import LLAMA3_SPECIAL, load_tokenizer
from fourd.errors import FourdError

pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")


def write_bpe(path, merges):
    """Ranks 0..255 are the bytes; then the merged tokens in order."""
    tokens = [bytes([b]) for b in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))


def test_tiktoken_file_encodes_with_its_merges(tmp_path):
    path = tmp_path / "tokenizer.model"
    write_bpe(path, [b"th", b"he", b"the", b" c"])
    tok = load_tokenizer(str(path))
    # "the" merges th (256) first, then the (258); " cat" splits as " c"(259) a t under Llama 3's pattern
    assert tok.encode("the cat") == [258, 259, 97, 116]
    assert tok.decode([258, 259, 97, 116]) == "the cat"
    assert tok.vocab_size == 260 + LLAMA3_SPECIAL
    assert tok.decode([260, 261]) == "<|begin_of_text|><|end_of_text|>"
    assert tok.encode("<|end_of_text|>") == list(
        b"<|end_of_text|>"
    )  # prompt text never becomes a control token
    assert tok.identity().startswith("tiktoken:")


def test_tokenizer_json_encodes_with_its_merges(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "Ġ": 5, "Ġa": 6}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "c"), ("Ġ", "a")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path / "tokenizer.json"))
    # " ab" is Ġab: the merge (a, b) ranks before (Ġ, a), so it splits Ġ | ab
    assert t.encode("abc ab") == [4, 5, 3]
    assert t.encode("abc a") == [4, 6]
    assert t.decode([4, 5, 3]) == "abc ab"
    assert t.vocab_size == 7 and t.identity().startswith("hf:")


def test_byte_tokenizer_stays_the_default():
    tok = load_tokenizer("byte")
    assert tok.encode("é!") == [0xC3, 0xA9, 0x21] and tok.vocab_size == 256


@pytest.mark.parametrize(
    "content, needle",
    [
        ("bm90IGEgdG9rZW4= zero\n", "not a tiktoken BPE line"),
        ("YQ== 0\nYg== 5\n", "ranks are not 0..1 each once"),
        ('{"model": 1}', "not a valid Hugging Face tokenizer.json"),
    ],
)
def test_malformed_tokenizer_files(tmp_path, content, needle):
    path = tmp_path / "tok"
    path.write_text(content)
    with pytest.raises(FourdError, match=needle.replace(".", r"\.")):
        load_tokenizer(str(path))


def test_fourd_imports_without_the_tokenizer_libraries(tmp_path):
    write_bpe(tmp_path / "tokenizer.model", [])
    code = (
        "import sys; sys.modules['tiktoken'] = None; sys.modules['tokenizers'] = None; sys.modules['transformers'] = None\n"
        "import fourd.cli, fourd.hf.convert, fourd.hf.generate, fourd.data.tokenizer\n"
        "from fourd.data.tokenizer import load_tokenizer\n"
        "try:\n    load_tokenizer(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "tokenizer.model")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        out.stdout.strip()
        == "FourdError reading this tokenizer file needs the 'tiktoken' package: pip install 'fourd[hf]'"
    )


@settings(max_examples=200, deadline=None)
@given(spec=st.text(max_size=40))
def test_any_tokenizer_spec_is_a_tokenizer_or_one_line(spec):
    try:
        assert load_tokenizer(spec).vocab_size >= 256
    except FourdError as e:
        assert str(e) and "\n" not in str(e)


B64 = st.binary(min_size=1, max_size=3).map(lambda b: base64.b64encode(b))
# all 256 bytes, then any multi-byte tokens: merges that may or may not be reachable
MERGES = st.lists(st.binary(min_size=2, max_size=4), max_size=6, unique=True).map(
    lambda extra: b"\n".join(
        base64.b64encode(t) + b" %d" % r
        for r, t in enumerate([bytes([b]) for b in range(256)] + extra)
    )
)
LINE = st.tuples(B64 | st.binary(max_size=6), st.integers(-2, 8)).map(
    lambda t: t[0] + b" " + str(t[1]).encode()
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    raw=st.lists(LINE, max_size=8).map(b"\n".join)
    | st.binary(max_size=60)
    | st.just(b'{"model": {"type": "BPE"}}')
    | MERGES
)
def test_any_tokenizer_file_is_a_tokenizer_or_one_line(tmp_path, raw):
    (tmp_path / "tok").write_bytes(raw)
    try:
        tok = load_tokenizer(str(tmp_path / "tok"))
        assert tok.decode(tok.encode("ab")) == "ab"
    except FourdError as e:
        assert str(e) and "\n" not in str(e)


@pytest.mark.timeout(60)
def test_a_fifo_or_device_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    for path in (tmp_path / "pipe", "/dev/zero"):
        with pytest.raises(FourdError) as e:
            load_tokenizer(str(path))
        assert str(e.value) == (
            f"tokenizer '{path}' is not a regular file (a FIFO, device, socket or system file): "
            "give 'byte' or the path of a tokenizer.json or tiktoken BPE file"
        )


def test_a_tiktoken_files_special_tokens_follow_its_ranks(tmp_path):
    """260 ranks, then Llama 3's 256 special tokens: begin (260), end of text (261), 254 reserved; the
    end-of-document token is 261 and the vocabulary 516."""
    path = tmp_path / "tokenizer.model"
    write_bpe(path, [b"th", b"he", b"the", b" c"])
    tok = load_tokenizer(str(path))
    assert tok.special_token() == ("<|end_of_text|>", 261)
    assert (tok.vocab_size, tok._enc.n_vocab) == (516, 516)
    assert tok.decode([515]) == "<|reserved_special_token_253|>"
    # an odd count of ranks: 257, so end of text is 258
    write_bpe(path, [b"th"])
    assert load_tokenizer(str(path)).special_token() == ("<|end_of_text|>", 258)


def test_a_tokenizer_json_counts_and_decodes_its_added_special_tokens(tmp_path):
    from tokenizers import AddedToken, Tokenizer, models

    vocab = {"a": 0, "b": 1, "ab": 2}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert t.vocab_size == 4
    assert t.special_token() == ("<|endoftext|>", 3)
    assert t.decode([2, 3]) == "ab <|endoftext|>"  # no decoder set: pieces joined by spaces


def test_a_malformed_bpe_line_is_named_by_its_line_number(tmp_path):
    path = tmp_path / "tok"
    path.write_text("YQ== 0\nnot-base64 zero\n")
    with pytest.raises(FourdError, match=rf"^{re.escape(str(path))}:2: not a tiktoken BPE line"):
        load_tokenizer(str(path))


def test_a_broken_tokenizer_json_quotes_eighty_characters_of_the_librarys_message(tmp_path):
    from tokenizers import Tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(
        '{"model": {"type": "NoSuchModelTypeAtAll", "vocab": {}, "merges": []}, "x": '
        + "1" * 200
        + "}"
    )
    with pytest.raises(Exception) as library:
        Tokenizer.from_str(path.read_text())
    with pytest.raises(FourdError) as refused:
        load_tokenizer(str(path))
    assert len(str(library.value)) > 80
    assert str(refused.value) == (
        f"{path}: not a valid Hugging Face tokenizer.json ({str(library.value)[:80]})"
    )


def test_a_tokenizer_json_that_adds_a_begin_token_adds_none_when_fourd_encodes(tmp_path):
    from tokenizers import Tokenizer, models, processors

    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "<s>": 3}, merges=[("a", "b")]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert t.encode("ab") == [2]
    assert [ids.tolist() for ids in t.encode_batch(["ab", "a"])] == [[2], [0]]


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda lines: lines[:100] + [""] + lines[100:], None),  # a blank line: skipped
        (lambda lines: ["A!A== 0"] + lines[1:], ":1: not a tiktoken BPE line"),  # not base64
        (lambda lines: lines[:255] + [lines[255].replace(" 255", " 254")], "ranks are not 0..255"),
        (lambda lines: ["~" + lines[0]] + lines[1:], ":1: not a tiktoken BPE line"),  # not JSON
    ],
)
def test_a_bpe_file_line_by_line(tmp_path, change, needle):
    path = tmp_path / "tokenizer.model"
    write_bpe(path, [])
    path.write_text("\n".join(change(path.read_text().splitlines())) + "\n")
    if needle is None:
        assert load_tokenizer(str(path)).vocab_size == 256 + LLAMA3_SPECIAL
        return
    with pytest.raises(FourdError, match=re.escape(needle)):
        load_tokenizer(str(path))
