import json

import numpy as np
import pytest

from fourd.config import build_config
from fourd.data.dataset import SampleStream, prepare
from fourd.errors import FourdError


def _stream(tmp_path, text="abcdefghij" * 200, seq=16, seed=0, name="c.txt"):
    f = tmp_path / name
    f.write_text(text)
    return SampleStream(prepare(str(f), "byte", str(tmp_path / "cache")), seq, seed, holdout_fraction=0.1)


def test_byte_tokens_round_trip_and_cache_is_reused(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("héllo wörld\n" * 50)
    c1 = prepare(str(f), "byte", str(tmp_path / "cache"))
    assert c1.tokens == len(("héllo wörld\n" * 50).encode())
    assert bytes(c1.array()[:6]) == "héllo".encode()
    mtime = c1.path.stat().st_mtime_ns
    c2 = prepare(str(f), "byte", str(tmp_path / "cache"))
    assert c2.path == c1.path and c2.path.stat().st_mtime_ns == mtime
    f.write_text("other text " * 50)  # different content, different key
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
    other = SampleStream(prepare(str(tmp_path / "c.txt"), "byte", str(tmp_path / "cache")), 16, 1, 0.1)
    assert not np.array_equal(other.samples(0, 8), s.samples(0, 8))


def test_an_epoch_visits_every_window_once(tmp_path):
    s = _stream(tmp_path)
    starts = sorted(int(s._order(0)[j]) for j in range(s.windows))
    assert starts == list(range(s.windows))
    assert s.samples(0, 1).shape == (1, 17)
    assert len(s.holdout()) == 2000 - s.train_tokens


def test_folder_and_jsonl_sources(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("first")
    (d / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n" + json.dumps({"text": "third"}) + "\n")
    (d / ".hidden").write_text("never")
    c = prepare(str(d), "byte", str(tmp_path / "cache"))
    assert bytes(c.array()) == b"first\n\nsecond\n\nthird"


@pytest.mark.parametrize(
    "setup,needle",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text(""), "holds no text"),
        (lambda p: p.write_bytes(b"ok\xff\xfe bad"), "not UTF-8"),
    ],
)
def test_bad_data_is_refused_with_one_clear_line(tmp_path, setup, needle):
    f = tmp_path / "data.txt"
    setup(f)
    with pytest.raises(FourdError, match=needle):
        prepare(str(f), "byte", str(tmp_path / "cache"))


def test_bad_jsonl_names_the_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "fine"}\n{"txt": "no"}\n')
    with pytest.raises(FourdError, match=r"d.jsonl:2: no string field"):
        prepare(str(f), "byte", str(tmp_path / "cache"))


def test_config_layers_and_refusals(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = 7\nlr = 0.01\n[parallel]\nlayout = "dp=2"\n')
    cfg = build_config(str(toml), {"train.steps": 9}, ["--train.lr=0.002", "--parallel.sequence_parallel", "true"])
    assert (cfg.train.steps, cfg.train.lr, cfg.parallel.layout, cfg.parallel.sequence_parallel) == (
        9,
        0.002,
        "dp=2",
        True,
    )
    with pytest.raises(FourdError, match=r"unknown config key 'train.lrr'.*allowed keys in \[train\] are steps"):
        build_config(None, {}, ["--train.lrr=1"])
    with pytest.raises(FourdError, match="train.steps = 'x' is not a valid int"):
        build_config(None, {}, ["--train.steps=x"])
    with pytest.raises(FourdError, match="allowed values are gpipe, 1f1b, interleaved, zero-bubble"):
        build_config(None, {}, ["--parallel.schedule=fast"])
    with pytest.raises(FourdError, match="train.steps = 0 must be at least 1"):
        build_config(None, {"train.steps": 0}, [])
    toml.write_text("[train\nsteps=")
    with pytest.raises(FourdError, match="is not valid TOML"):
        build_config(str(toml), {}, [])
