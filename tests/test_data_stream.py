"""Corpora, the token cache and the sample stream: order, the held-out tail, bad data."""

import json
import os
import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fourd.config import build_config
from fourd.data.dataset import SampleStream, TokenCache, prepare
from fourd.data.sources import DocumentReader, list_sources
from fourd.errors import FourdError


def _stream(tmp_path, text="abcdefghij" * 200, seq=16, seed=0, name="c.txt"):
    f = tmp_path / name
    f.write_text(text)
    return SampleStream(
        prepare(str(f), "byte", str(tmp_path / "cache")), seq, seed, holdout_fraction=0.1
    )


def test_byte_tokens_round_trip_and_cache_is_reused(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("héllo wörld\n" * 50)
    c1 = prepare(str(f), "byte", str(tmp_path / "cache"))
    assert c1.tokens == len(("héllo wörld\n" * 50).encode())
    assert bytes(c1.array()[:6].astype(np.uint8)) == "héllo".encode()
    mtime = (c1.path / "manifest.json").stat().st_mtime_ns
    c2 = prepare(str(f), "byte", str(tmp_path / "cache"))
    assert c2.path == c1.path and (c2.path / "manifest.json").stat().st_mtime_ns == mtime
    f.write_text("other text " * 50)  # another size and modification time: another entry
    assert prepare(str(f), "byte", str(tmp_path / "cache")).path != c1.path


def test_data_order_depends_on_seed_only_not_on_ranks(tmp_path):
    s = _stream(tmp_path, text="".join(chr(97 + i % 26) + str(i) for i in range(3000)))
    B = 8
    for step in range(3):
        whole = s.samples(step * B, B)
        for dp in (2, 4, 8):
            per = B // dp
            parts = np.concatenate([s.samples(step * B + r * per, per) for r in range(dp)])
            assert np.array_equal(parts, whole)
    again = _stream(tmp_path, text="".join(chr(97 + i % 26) + str(i) for i in range(3000)))
    assert np.array_equal(again.samples(0, 40), s.samples(0, 40))
    other = SampleStream(
        prepare(str(tmp_path / "c.txt"), "byte", str(tmp_path / "cache")), 16, 1, 0.1
    )
    assert not np.array_equal(other.samples(0, 8), s.samples(0, 8))


def _positions(tmp_path, n):
    """A token cache whose token at position i is i: a sample shows which positions it read."""
    path = tmp_path / "positions.bin"
    np.arange(n, dtype=np.uint32).tofile(path)
    return TokenCache(path=path, tokens=n, vocab_size=n, dtype="uint32", source="positions")


def _last_position_read(stream, samples):
    return max(int(stream.sample(i).max()) for i in range(samples))


def test_an_epoch_visits_every_window_once(tmp_path):
    s = SampleStream(_positions(tmp_path, 1000), 16, seed=0, holdout_fraction=0.1)
    first = [int(s.sample(i)[0]) for i in range(56)]
    assert sorted(first) == list(
        range(0, 896, 16)
    )  # 900 training positions hold 56 windows of 16 + 1
    second = [int(s.sample(i)[0]) for i in range(56, 112)]
    assert (
        sorted(second) == sorted(first) and second != first
    )  # the next epoch: the same windows, reshuffled
    assert all(
        s.sample(i).tolist() == list(range(start, start + 17)) for i, start in enumerate(first)
    )


def test_no_training_sample_reaches_the_held_out_tail(tmp_path):
    s = SampleStream(_positions(tmp_path, 1000), 16, seed=0, holdout_fraction=0.1)
    assert s.holdout().tolist() == list(range(900, 1000))  # the last tenth of the stream
    assert _last_position_read(s, 200) == 896 < 900  # over three epochs and more


def test_folder_and_jsonl_sources(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("first")
    (d / "b.jsonl").write_text(
        json.dumps({"text": "second"}) + "\n" + json.dumps({"text": "third"}) + "\n"
    )
    (d / ".hidden").write_text("never")
    c = prepare(str(d), "byte", str(tmp_path / "cache"))
    assert bytes(c.array().astype(np.uint8)) == b"first\n\nsecond\n\nthird"


def _socket(p):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    return s


FIX = "give a text file, a folder of text files or a .jsonl file"
NOT_REGULAR = f"is not a regular file (a FIFO, device, socket or system file): {FIX}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name, setup, message",
    [
        ("data.txt", lambda p: None, f"data path '{{p}}' does not exist: {FIX}"),
        (
            "data.txt",
            lambda p: p.write_text(""),
            f"data path '{{p}}' holds no text: {FIX} that is not empty",
        ),
        (
            "data.txt",
            lambda p: p.write_bytes(b"ok\xff\xfe bad"),
            "data file '{p}' is not UTF-8 text (byte 2): convert it to UTF-8 or leave it out",
        ),
        ("data.txt", os.mkfifo, f"data file '{{p}}' {NOT_REGULAR}"),
        ("data.txt", _socket, f"data file '{{p}}' {NOT_REGULAR}"),
        (
            "data.txt",
            lambda p: p.symlink_to("/dev/zero"),
            f"data path '{{p}}' lies in a system file system: {FIX}",
        ),
        (
            "data.txt",
            lambda p: p.symlink_to("/proc/self/status"),
            f"data path '{{p}}' lies in a system file system: {FIX}",
        ),
        (
            "dir",
            lambda p: (p.mkdir(), os.mkfifo(p / "pipe")),
            f"data file '{{p}}/pipe' {NOT_REGULAR}",
        ),
        (
            "d.jsonl",
            lambda p: p.write_text('{"text": "fine"}\n{"txt": "no"}\n'),
            '{p}:2: no string field "text"; each line must be an object with a "text" field',
        ),
    ],
)
def test_bad_data_is_refused_with_one_clear_line(tmp_path, name, setup, message):
    f = tmp_path / name
    keep = setup(f)  # a socket lives while its object does
    with pytest.raises(FourdError) as e:
        prepare(str(f), "byte", str(tmp_path / "cache"))
    assert str(e.value) == message.format(p=f)
    del keep


def test_too_short_a_corpus_says_how_many_tokens_are_needed(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_text("hello world")  # 11 bytes
    cache = prepare(str(f), "byte", str(tmp_path / "cache"))
    with pytest.raises(FourdError) as e:
        SampleStream(cache, 256, seed=0, holdout_fraction=0.01)
    assert str(e.value) == (
        "the corpus has 11 tokens, too few for one training sequence: 260 are needed "
        "(data.seq_len 256 + 1, plus the held-out 1%); give more text or a smaller data.seq_len"
    )
    assert (
        int(260 * 0.99) == 257 > int(259 * 0.99)
    )  # 260 is the fewest that leave 257 training tokens


@pytest.mark.parametrize(
    "cache_dir, reason",
    [("file", "File exists"), ("file/sub", "Not a directory"), ("/proc/x", "No such file")],
)
def test_a_cache_dir_that_cannot_hold_the_cache_is_one_line(tmp_path, cache_dir, reason):
    (tmp_path / "file").write_text("x")
    (tmp_path / "c.txt").write_text("some text")
    where = cache_dir if cache_dir.startswith("/") else str(tmp_path / cache_dir)
    with pytest.raises(FourdError) as e:
        prepare(str(tmp_path / "c.txt"), "byte", where)
    assert str(e.value).startswith(
        f"data.cache_dir '{where}' cannot hold the token cache ({reason}"
    )
    assert str(e.value).endswith("): give a writable folder")


def test_a_damaged_cache_entry_is_rebuilt(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("abc " * 100)
    first = prepare(str(f), "byte", str(tmp_path / "cache"))
    (first.path / "manifest.json").write_text('{"tokens": "many"')
    again = prepare(str(f), "byte", str(tmp_path / "cache"))
    assert again.tokens == 400 and bytes(again.array().astype(np.uint8)) == b"abc " * 100


LINES = st.text(max_size=30) | st.sampled_from(
    ['{"text": 1}', "[]", '{"text": "x"}', "[" * 5000, "\x00"]
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(LINES, max_size=5))
def test_any_jsonl_ends_in_documents_or_one_line(tmp_path, lines):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines))
    try:
        (source,) = list_sources([str(f)])
        docs = list(DocumentReader(source).documents())
        assert all(isinstance(d, str) and d for d in docs)
    except FourdError as e:
        assert "\n" not in str(e)


def test_config_layers_and_refusals(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = 7\nlr = 0.01\n[parallel]\nlayout = "dp=2"\n')
    cfg = build_config(
        str(toml), {"train.steps": 9}, ["--train.lr=0.002", "--parallel.sequence_parallel", "true"]
    )
    assert (cfg.train.steps, cfg.train.lr, cfg.parallel.layout, cfg.parallel.sequence_parallel) == (
        9,
        0.002,
        "dp=2",
        True,
    )
    with pytest.raises(
        FourdError, match=r"unknown config key 'train.lrr'.*allowed keys in \[train\] are steps"
    ):
        build_config(None, {}, ["--train.lrr=1"])
    with pytest.raises(FourdError, match="train.steps = 'x' is not a valid int"):
        build_config(None, {}, ["--train.steps=x"])
    with pytest.raises(
        FourdError, match="allowed values are gpipe, 1f1b, interleaved, zero-bubble"
    ):
        build_config(None, {}, ["--parallel.schedule=fast"])
    with pytest.raises(FourdError, match="train.steps = 0 must be at least 1"):
        build_config(None, {"train.steps": 0}, [])
    toml.write_text("[train\nsteps=")
    with pytest.raises(FourdError, match="is not valid TOML"):
        build_config(str(toml), {}, [])
