"""Corpora, the token cache and the sample stream: order, the held-out tail, bad data."""

import base64
import dataclasses
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fourd.config import DataSection, build_config
from fourd.data.dataset import (
    MIX_BLOCK,
    Mixture,
    SampleStream,
    TokenCache,
    TokenDataset,
    _block_counts,
    held_out_start,
    is_prepared,
    open_data,
    open_prepared,
    parse_mix,
    prepare,
    split,
)
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


# --- the dataset's pieces, each with numbers worked out by hand -----------------------------------------


def _shards(tmp_path, counts, tokens=None, dtype="uint16"):
    """A dataset of shard files whose token at stream position i is i."""
    names, start = [], 0
    for k, count in enumerate(counts):
        name = f"s{k}.bin"
        np.arange(start, start + count, dtype=dtype).tofile(tmp_path / name)
        names.append((name, count))
        start += count
    return TokenDataset(
        path=tmp_path,
        tokens=start if tokens is None else tokens,
        vocab_size=max(start, 1),
        dtype=dtype,
        source="shards",
        shards=tuple(names),
    )


def test_reads_cross_shard_boundaries_and_stop_at_the_streams_end(tmp_path):
    data = _shards(tmp_path, [4, 0, 6], tokens=9)  # an empty shard; the last id not in the stream
    assert data.read(2, 7).tolist() == [2, 3, 4, 5, 6]
    assert data.read(0, 4).tolist() == [0, 1, 2, 3]
    assert data.read(4, 5).tolist() == [4]
    assert data.read(7, 20).tolist() == [7, 8]
    assert data.read(9, 12).tolist() == [] and data.read(9, 12).dtype == np.int64
    assert data.read(3, 5).dtype == np.int64
    assert data.array().tolist() == list(range(9))
    (tmp_path / "one").mkdir()
    one = _shards(tmp_path / "one", [5], tokens=4)
    assert one.array().tolist() == [0, 1, 2, 3]
    assert data.document_starts() is None  # no .idx files


def test_the_held_out_tail_starts_at_a_document_start_when_one_lies_in_it():
    assert held_out_start(1000, 0.1, None) == 900
    assert held_out_start(1000, 0.1, np.array([], dtype=np.int64)) == 900
    assert held_out_start(1000, 0.1, np.array([0, 850, 905, 990])) == 905
    assert held_out_start(1000, 0.1, np.array([0, 850, 900, 990])) == 900
    assert held_out_start(1000, 0.1, np.array([0, 850])) == 900  # the last document is long
    assert held_out_start(1000, 0.1, np.array([0, 850, 1000])) == 900  # a start at the very end


def test_the_manifests_held_out_start_is_used_for_its_own_fraction(tmp_path):
    data = TokenCache(
        path=tmp_path, tokens=1000, vocab_size=1000, dtype="uint16", source="x", holdout=(0.1, 950)
    )
    assert data.held_out_start(0.1) == 950
    assert data.held_out_start(0.2) == 800  # another fraction: computed, no document index
    assert data.split(16, 0.1) == (950, 59)  # (950 − 1) // 16


def test_split_counts_windows_and_refuses_a_corpus_too_short():
    assert split(1000, 16, 0.1) == (900, 56)  # (900 − 1) // 16
    assert split(1000, 16, 0.1, lambda fraction: 905) == (905, 56)
    assert split(17, 16, 0.0) == (17, 1)  # one window of 16 + 1 tokens
    for fraction in (0.5, -0.1):
        with pytest.raises(FourdError) as e:
            split(1000, 16, fraction)
        assert str(e.value) == f"data.holdout_fraction = {fraction} must be in [0, 0.5)"
    # 23 tokens keep int(23 · 0.75) = 17 for training; 22 keep 16
    for tokens, fraction, need, percent in [(16, 0.0, 17, "0%"), (22, 0.25, 23, "25%")]:
        with pytest.raises(FourdError) as e:
            split(tokens, 16, fraction)
        assert str(e.value) == (
            f"the corpus has {tokens} tokens, too few for one training sequence: {need} are needed "
            f"(data.seq_len 16 + 1, plus the held-out {percent}); give more text or a smaller "
            "data.seq_len"
        )


def test_the_held_out_span_reads_like_an_array(tmp_path):
    s = SampleStream(_positions(tmp_path, 1000), 16, seed=0, holdout_fraction=0.1)
    span = s.holdout()
    assert (len(span), s.held_out_tokens) == (100, 100)
    assert span[2:5].tolist() == [902, 903, 904]
    assert span[5:2].tolist() == []
    assert span[-3:].tolist() == [997, 998, 999]
    assert np.asarray(span).tolist() == list(range(900, 1000))
    assert np.asarray(span).dtype == np.int64 and np.asarray(span, dtype=np.int32).dtype == np.int32
    assert span.tolist() == list(range(900, 1000))


def test_a_folder_is_a_prepared_dataset_only_with_its_manifest(tmp_path):
    assert not is_prepared("") and not is_prepared(str(tmp_path))
    with pytest.raises(FourdError) as e:
        open_prepared(tmp_path)
    assert str(e.value).startswith(f"{tmp_path}/manifest.json cannot be read (")
    assert str(e.value).endswith(
        "): the folder is not a complete prepared dataset; prepare it again with `fourd data prepare`"
    )
    (tmp_path / "progress.json").write_text("{}")
    with pytest.raises(FourdError) as e:
        prepare(str(tmp_path), "byte", str(tmp_path / "cache"))
    assert str(e.value) == (
        f"data.path {tmp_path} is an unfinished prepared dataset (no manifest.json): run its "
        "`fourd data prepare` again (or `fourd data merge` after its tasks) to finish it"
    )


def test_a_prepared_folder_is_read_as_it_is_and_named_by_its_source(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("abc " * 100)
    entry = prepare(str(f), "byte", str(tmp_path / "cache"))
    assert is_prepared(str(entry.path)) and entry.source == str(f)
    again = prepare(str(entry.path), "", str(tmp_path / "elsewhere"))
    assert (again.path, again.tokens, again.source) == (entry.path, 400, str(f))
    assert not (tmp_path / "elsewhere").exists()
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("first")
    (d / "b.txt").write_text("second")
    assert prepare(str(d), "byte", str(tmp_path / "cache")).source == f"{d} (2 files)"


def test_the_default_cache_is_named_when_it_cannot_be_made(tmp_path, monkeypatch):
    monkeypatch.setenv("FOURD_HOME", "/proc/no-home")
    (tmp_path / "c.txt").write_text("some text")
    with pytest.raises(FourdError) as e:
        prepare(str(tmp_path / "c.txt"), "byte")
    assert str(e.value).startswith(
        "the default cache under $FOURD_HOME '/proc/no-home/cache' cannot hold the token cache ("
    )


def test_mix_specs_are_dir_weight_pairs_of_positive_weights():
    assert parse_mix("a=0.7,b=0.3") == [("a", 0.7), ("b", 0.3)]
    assert parse_mix(" x/y=2 , z=1e-3") == [("x/y", 2.0), ("z", 0.001)]
    assert parse_mix("a=b=1") == [("a=b", 1.0)]
    for item in ("a", "=0.5"):
        with pytest.raises(FourdError) as e:
            parse_mix(f"{item},c=1")
        assert str(e.value) == (
            f"data.mix item {item!r} is not DIR=WEIGHT: give e.g. data/a=0.7,data/b=0.3"
        )
    for weight in ("0", "-1", "inf", "nan", "x", ""):
        with pytest.raises(FourdError) as e:
            parse_mix(f"c=1,a={weight}")
        assert str(e.value) == (
            f"data.mix weight of a is {weight!r}, not a positive number: give a weight > 0"
        )


def test_block_counts_are_exact_shares_rounded_by_the_largest_remainder():
    assert MIX_BLOCK == 4096
    assert _block_counts((1.0,)) == [4096]
    assert _block_counts((3.0, 1.0)) == [3072, 1024]
    assert _block_counts((0.7, 0.3)) == [2867, 1229]  # 2867.2 and 1228.8: the .8 rounds up
    assert _block_counts((1.0, 2.0)) == [1365, 2731]  # 1365.33 and 2730.67
    assert _block_counts((1.0, 1.0, 1.0)) == [1366, 1365, 1365]  # a tie: the first


def test_a_mixture_names_its_parts_and_holds_out_its_firsts_tail(tmp_path):
    a = _shards(tmp_path, [1000])
    (tmp_path / "b").mkdir()
    b = _shards(tmp_path / "b", [3000])
    b = dataclasses.replace(b, vocab_size=5000, identity="other", tokenizer="t.json")
    mix = Mixture(parts=(a, b), weights=(0.7, 0.3), spec="a=0.7,b=0.3")
    assert (mix.tokens, mix.vocab_size, mix.identity, mix.tokenizer) == (4000, 5000, "", "byte")
    assert mix.source == "mixture shards 0.7, shards 0.3"
    stream = mix.stream(16, seed=0, holdout_fraction=0.1)
    assert stream.held_out_tokens == 100
    assert stream.holdout().tolist() == list(range(900, 1000))
    assert stream.samples(0, 3).shape == (3, 17)


def test_the_data_section_names_a_mixture_or_a_path_not_both(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(name * 500)
    cache = str(tmp_path / "cache")
    section = DataSection(mix=f"{tmp_path}/a.txt=1,{tmp_path}/b.txt=3", cache_dir=cache)
    mix = open_data(section)
    assert (mix.weights, mix.tokens, [p.source for p in mix.parts]) == (
        (1.0, 3.0),
        1000,
        [f"{tmp_path}/a.txt", f"{tmp_path}/b.txt"],
    )
    one = open_data(DataSection(path=f"{tmp_path}/a.txt", cache_dir=cache))
    assert (one.tokens, one.source) == (500, f"{tmp_path}/a.txt")
    with pytest.raises(FourdError) as e:
        open_data(DataSection(path="x", mix="a=1"))
    assert str(e.value) == (
        "data.mix and data.path = 'x' are both set: give one (data.mix names every dataset of the "
        "mixture)"
    )


def _bpe(path, merges=(b"ab", b"abc")):
    """A tiktoken BPE file: the 256 bytes, then the merges."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return str(path)


def test_datasets_of_other_tokenizers_are_refused_by_name(tmp_path):
    pytest.importorskip("tiktoken")
    (tmp_path / "c.txt").write_text("abc " * 100)
    cache = str(tmp_path / "cache")
    by_bytes = prepare(str(tmp_path / "c.txt"), "byte", cache).path
    by_bpe = prepare(str(tmp_path / "c.txt"), _bpe(tmp_path / "t.model"), cache).path
    assert by_bytes != by_bpe
    with pytest.raises(FourdError) as e:
        open_data(DataSection(mix=f"{by_bytes}=1,{by_bpe}=1", cache_dir=cache))
    assert str(e.value) == (
        f"data.mix: {by_bpe} was tokenized by another tokenizer than {by_bytes}: prepare every "
        "dataset of a mixture with the same tokenizer"
    )
    with pytest.raises(FourdError) as e:  # in either order
        open_data(DataSection(mix=f"{by_bpe}=1,{by_bytes}=1", cache_dir=cache))
    assert str(e.value) == (
        f"data.mix: {by_bytes} was tokenized by another tokenizer than {by_bpe}: prepare every "
        "dataset of a mixture with the same tokenizer"
    )
    with pytest.raises(FourdError) as e:
        prepare(str(by_bytes), str(tmp_path / "t.model"), cache)
    assert str(e.value) == (
        f"data.path {by_bytes} was prepared with another tokenizer than data.tokenizer "
        f"{tmp_path / 't.model'}: drop data.tokenizer to use its own"
    )
    assert prepare(str(by_bpe), str(tmp_path / "t.model"), cache).path == by_bpe  # its own


def test_one_shard_is_read_as_a_memory_map_of_its_own_type(tmp_path):
    one = _shards(tmp_path, [5], tokens=4, dtype="uint32")
    whole = one.array()
    assert isinstance(whole, np.memmap) and whole.dtype == np.uint32
    assert whole.tolist() == [0, 1, 2, 3]


def test_a_long_document_index_and_the_default_held_out_share(tmp_path):
    # 300 document starts (past CPython's 256 small ints), none in the tail: the point itself
    assert held_out_start(10_000, 0.1, np.arange(300)) == 9000
    assert held_out_start(10_000, 0.1, np.arange(0, 10_000, 30)) == 9000  # a start at 9000
    assert held_out_start(10_000, 0.1, np.arange(5, 10_000, 30)) == 9005
    # without a fraction, 1 % is held out, as data.holdout_fraction's default
    s = SampleStream(_positions(tmp_path, 1000), 16, seed=0)
    assert (s.train_tokens, s.windows, s.held_out_tokens) == (990, 61, 10)


def test_more_edges_of_the_split_and_the_shards(tmp_path):
    with pytest.raises(FourdError) as e:
        split(1000, 16, 0.6)
    assert str(e.value) == "data.holdout_fraction = 0.6 must be in [0, 0.5)"
    # 18 tokens keep int(18 · 0.95) = 17 for training; 17 keep 16
    with pytest.raises(FourdError) as e:
        split(17, 16, 0.05)
    assert "too few for one training sequence: 18 are needed" in str(e.value)
    data = _shards(tmp_path, [1, 2])  # a shard of one token
    assert data.read(0, 3).tolist() == [0, 1, 2] and data.read(0, 1).tolist() == [0]


@pytest.mark.parametrize(
    "manifest", ['{"tokens": "many"', "{}", '{"shards": 5, "holdout": {}}', '["a list"]']
)
def test_a_manifest_that_cannot_be_read_is_one_line(tmp_path, manifest):
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(FourdError) as e:
        open_prepared(tmp_path)
    assert str(e.value).startswith(f"{tmp_path}/manifest.json cannot be read (")
    assert str(e.value).endswith("prepare it again with `fourd data prepare`")


def test_a_prepared_corpus_holds_out_whole_documents_at_any_fraction(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("a" * 600)
    (d / "b.txt").write_text("b" * 400)
    data = prepare(str(d), "byte", str(tmp_path / "cache"))
    # 600 + the blank line + 400 = 1002 tokens, the second document from 602
    assert (data.tokens, data.document_starts().tolist()) == (1002, [0, 602])
    # 45 % held out: the point int(1002 · 0.55) = 551 moves on to the start of b
    s = data.stream(16, seed=0, holdout_fraction=0.45)
    assert (s.train_tokens, s.holdout().tolist()) == (602, [98] * 400)


def test_one_jsonl_file_is_named_with_its_count(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert prepare(str(f), "byte", str(tmp_path / "cache")).source == f"{f} (1 files)"


def test_datasets_and_mixtures_are_immutable(tmp_path):
    data = _shards(tmp_path, [4])
    with pytest.raises(AttributeError):
        data.tokens = 3  # type: ignore[misc]
    mix = Mixture(parts=(data,), weights=(1.0,), spec="x=1")
    with pytest.raises(AttributeError):
        mix.spec = "y=1"  # type: ignore[misc]


def test_reads_that_end_before_a_shard_or_start_past_the_last(tmp_path):
    data = _shards(tmp_path, [4, 0, 6], tokens=9)
    assert data.read(0, 2).tolist() == [0, 1]  # the later shards begin after it
    assert data.read(10, 12).tolist() == [] and data.read(10, 12).dtype == np.int64
    # no tail held out: the held-out span is empty
    s = SampleStream(_positions(tmp_path, 1000), 16, seed=0, holdout_fraction=0.0)
    assert (len(s.holdout()), s.holdout().tolist(), s.held_out_tokens) == (0, [], 0)


def test_every_part_of_a_mixture_is_read_in_its_own_order(tmp_path):
    # part b's token at position i is 100,000 + i: a sample's first token says whose it is
    a = _shards(tmp_path, [3000])
    np.arange(100_000, 102_000, dtype=np.uint32).tofile(tmp_path / "b.bin")
    b = TokenDataset(
        path=tmp_path / "b.bin", tokens=2000, vocab_size=102_000, dtype="uint32", source="b"
    )
    mix = Mixture(parts=(a, b), weights=(3.0, 1.0), spec="a=3,b=1")
    stream = mix.stream(8, seed=1, holdout_fraction=0.0)
    firsts = [int(stream.sample(i)[0]) for i in range(MIX_BLOCK)]
    for part, count in ((0, 3072), (1, 1024)):  # 3/4 and 1/4 of the block
        mine = [first for first in firsts if (first >= 100_000) == bool(part)]
        own = mix.parts[part].stream(8, seed=1, holdout_fraction=0.0)
        assert mine == [int(own.sample(k)[0]) for k in range(count)], part


def test_a_cache_dir_is_made_with_its_parents(tmp_path):
    (tmp_path / "c.txt").write_text("some text " * 10)
    data = prepare(str(tmp_path / "c.txt"), "byte", str(tmp_path / "x" / "y" / "cache"))
    assert data.path.parent == tmp_path / "x" / "y" / "cache" and data.tokens == 100


def test_a_prepared_folder_refuses_another_bpe_whichever_sorts_first(tmp_path):
    pytest.importorskip("tiktoken")
    (tmp_path / "c.txt").write_text("abc bca " * 50)
    cache = str(tmp_path / "cache")
    one, two = _bpe(tmp_path / "one.model"), _bpe(tmp_path / "two.model", (b"bc", b"bca"))
    folders = {spec: prepare(str(tmp_path / "c.txt"), spec, cache).path for spec in (one, two)}
    for spec, other in ((one, two), (two, one)):
        with pytest.raises(FourdError) as e:
            prepare(str(folders[other]), spec, cache)
        assert str(e.value) == (
            f"data.path {folders[other]} was prepared with another tokenizer than data.tokenizer "
            f"{spec}: drop data.tokenizer to use its own"
        )


def test_a_document_start_past_the_stream_is_not_the_held_out_start():
    # an index may list the start after the last end-of-document ids, past `tokens`
    assert held_out_start(1000, 0.1, np.array([0, 1002])) == 900


def test_odd_sequence_lengths_and_runs_of_mixture_samples(tmp_path):
    # windows of 15 + 1 tokens: a sample is 16 positions from a multiple of 15
    s = SampleStream(_positions(tmp_path, 1000), 15, seed=0, holdout_fraction=0.1)
    for i in range(5):
        row = s.sample(i).tolist()
        assert len(row) == 16 and row == list(range(row[0], row[0] + 16)) and row[0] % 15 == 0
    # 20 tokens keep int(20 · 0.9) = 18 = 17 + 1 for training; 19 keep 17
    with pytest.raises(FourdError) as e:
        split(10, 17, 0.1)
    assert "too few for one training sequence: 20 are needed (data.seq_len 17 + 1" in str(e.value)
    # a run of samples is the samples one by one
    mix = Mixture(parts=(_shards(tmp_path, [3000]),), weights=(1.0,), spec="a=1")
    stream = mix.stream(8, seed=0, holdout_fraction=0.0)
    assert np.array_equal(stream.samples(5, 3), np.stack([stream.sample(i) for i in (5, 6, 7)]))
    # the first document start at or after the point, whatever the index holds
    assert held_out_start(1000, 0.1, np.array([950])) == 950


def test_a_run_of_samples_a_later_block_first_and_no_tail_on_a_prepared_corpus(tmp_path):
    s = SampleStream(_positions(tmp_path, 1000), 16, seed=0, holdout_fraction=0.1)
    assert np.array_equal(s.samples(5, 3), np.stack([s.sample(i) for i in (5, 6, 7)]))
    # a fresh mixture stream asked first for a sample of its second block (a resumed run)
    mix = Mixture(parts=(_shards(tmp_path, [3000]),), weights=(1.0,), spec="a=1")
    fresh, warm = mix.stream(8, 0, 0.0), mix.stream(8, 0, 0.0)
    warm.sample(0)
    assert np.array_equal(fresh.sample(MIX_BLOCK + 3), warm.sample(MIX_BLOCK + 3))
    # no tail held out of a corpus prepared with 1 %: every token trains
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("a" * 600)
    (d / "b.txt").write_text("b" * 400)
    data = prepare(str(d), "byte", str(tmp_path / "cache"))
    assert (data.held_out_start(0.0), data.stream(16, 0, 0.0).held_out_tokens) == (1002, 0)


def test_a_mixture_of_one_dataset_reads_its_samples_in_order(tmp_path):
    part = _shards(tmp_path, [3000])
    mix = Mixture(parts=(part,), weights=(1.0,), spec="a=1")
    stream, own = mix.stream(8, 0, 0.0), part.stream(8, 0, 0.0)
    assert [stream.sample(i).tolist() for i in range(5)] == [
        own.sample(i).tolist() for i in range(5)
    ]


def test_a_broken_jsonl_line_quotes_sixty_characters_of_the_parsers_message(tmp_path):
    """json's message here is 72 characters ("Expecting property name enclosed in double quotes: line 1
    column 2 (char 1)"): the line keeps its first 60."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n{\n')
    (source,) = list_sources([str(f)])
    with pytest.raises(FourdError) as refused:
        list(DocumentReader(source).documents())
    assert str(refused.value) == (
        f"{source.path}:2: not valid JSON (Expecting property name enclosed in double quotes: line 1 "
        'co); each line must be an object with a "text" field'
    )


def test_an_unreadable_columnar_file_quotes_eighty_characters_of_arrows_message(tmp_path):
    pytest.importorskip("pyarrow")
    f = tmp_path / "broken.parquet"
    f.write_bytes(b"not a parquet file at all, and long enough to have no footer either" * 4)
    (source,) = list_sources([str(f)])
    with pytest.raises(FourdError) as refused:
        list(DocumentReader(source).documents())
    quoted = str(refused.value).split(" file (", 1)[1].rsplit("): check the file", 1)[0]
    assert str(refused.value).startswith(f"{source.path}: not a readable Parquet file (")
    assert len(quoted) == 80


def _documents(path, **options):
    (source,) = list_sources([str(path)])
    return list(DocumentReader(source, **options).documents())


def test_jsonl_lines_blank_in_the_middle_and_no_newline_at_the_end(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n\n{"text": "b"}\n{"text": "c"}')
    assert _documents(f) == ["a", "b", "c"]


def test_a_text_file_that_is_not_utf8_is_refused_unless_asked_to_skip(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café".encode("latin-1"))
    with pytest.raises(FourdError, match=r"is not UTF-8 text \(byte 3\)"):
        _documents(f)
    assert _documents(f, skip_non_utf8=True) == []


def test_a_columnar_files_text_column_anywhere_and_a_column_that_is_not_text(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    f = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": [1, 2], "text": ["x", "y"]}), f)
    assert _documents(f) == ["x", "y"]
    with pytest.raises(FourdError, match='column "id" holds int64, not text'):
        _documents(f, field="id")


def test_every_path_given_is_listed_after_a_file_or_a_datasets_folder(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("a")
    second.write_text("b")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "x.arrow"}]}))
    (hf / "x.arrow").write_bytes(b"")
    found = list_sources([str(first), str(hf), str(second)])
    assert [os.path.basename(source.path) for source in found] == ["a.txt", "x.arrow", "b.txt"]


def test_a_folder_leaves_out_hidden_files_only(tmp_path):
    for name in ("-notes.txt", ",x", ".hidden", "plain"):
        (tmp_path / name).write_text("t")
    found = list_sources([str(tmp_path)])
    assert sorted(os.path.basename(source.path) for source in found) == [
        ",x",
        "-notes.txt",
        "plain",
    ]


def test_a_source_is_an_immutable_value(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (source,) = list_sources([str(tmp_path / "a.txt")])
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.size = 0  # type: ignore[misc]


def test_batches_hold_1024_documents_or_16_mib_whichever_comes_first(tmp_path):
    """2,049 one-character documents: 1,024, 1,024, 1. Then documents of 4 MiB, 4 MiB, 4 MiB, 4 MiB − 1
    and 1 character: the batch closes when it reaches 16 MiB, at the fifth; the next batch the same."""
    small = tmp_path / "small.jsonl"
    small.write_text("".join('{"text": "x"}\n' for _ in range(2049)))
    (source,) = list_sources([str(small)])
    assert [len(batch) for batch in DocumentReader(source).batches()] == [1024, 1024, 1]
    mib = 1 << 20
    sizes = [4 * mib, 4 * mib, 4 * mib, 4 * mib - 1, 1] * 2 + [1]
    large = tmp_path / "large.jsonl"
    large.write_text("".join(json.dumps({"text": "y" * size}) + "\n" for size in sizes))
    (source,) = list_sources([str(large)])
    assert [len(batch) for batch in DocumentReader(source).batches()] == [5, 5, 1]
    assert [len(batch) for batch in DocumentReader(source).batches(skip=10)] == [1]
    # 8 MiB then 8 MiB + 1: the batch passes 16 MiB without meeting it, and closes
    over = tmp_path / "over.jsonl"
    over.write_text(
        "".join(json.dumps({"text": "z" * size}) + "\n" for size in (8 * mib, 8 * mib + 1, 1))
    )
    (source,) = list_sources([str(over)])
    assert [len(batch) for batch in DocumentReader(source).batches()] == [2, 1]


def test_an_arrow_stream_file_reads_its_text_column_and_names_itself_when_broken(tmp_path):
    pa = pytest.importorskip("pyarrow")
    f = tmp_path / "c.arrow"
    table = pa.table({"id": [1, 2], "text": ["x", "y"]})
    with pa.OSFile(str(f), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert _documents(f) == ["x", "y"]
    broken = tmp_path / "broken.arrow"
    broken.write_bytes(b"not an arrow stream" * 8)
    with pytest.raises(FourdError, match=r": not a readable Arrow file \("):
        _documents(broken)


def test_a_compressed_corpus_without_its_library_is_refused_in_one_line(tmp_path):
    """zstandard made unimportable (sys.modules[...] = None), as on a machine without it."""
    f = tmp_path / "c.jsonl.zst"
    f.write_bytes(b"\x28\xb5\x2f\xfd")
    code = (
        "import sys; sys.modules['zstandard'] = None\n"
        "from fourd.data.sources import DocumentReader, list_sources\n"
        "from fourd.errors import FourdError\n"
        f"(source,) = list_sources([{str(f)!r}])\n"
        "try:\n    list(DocumentReader(source).documents())\n"
        "except FourdError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout == (
        "reading .jsonl.zst needs the 'zstandard' package: pip install 'fourd[data]'\n"
    )
