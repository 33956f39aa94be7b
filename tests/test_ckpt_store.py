import dataclasses
import json

import pytest
import torch

from fourd.ckpt import store
from fourd.errors import FourdError
from fourd.model.config import get_preset
from fourd.model.llama import build_model

CFG = get_preset("debug")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    sd = build_model(CFG, seed=3).state_dict()
    sd["output.weight"] = sd["output.weight"].to(torch.bfloat16)  # dtypes must survive as saved
    d = tmp_path_factory.mktemp("ck") / "step-7"
    store.save_model_checkpoint(d, CFG, sd, step=7, layout="tp=2,dp=2")
    return d, sd


def test_round_trip_is_bit_exact(saved):
    d, sd = saved
    cfg, got = store.load_model_checkpoint(d)
    assert cfg == CFG
    assert sorted(got) == sorted(sd)
    for k in sd:
        assert got[k].dtype == sd[k].dtype and torch.equal(got[k], sd[k]), k
    m = store.read_manifest(d)
    assert (m["step"], m["layout"], m["format"], m["version"]) == (
        7,
        "tp=2,dp=2",
        "fourd-checkpoint",
        1,
    )
    assert m["model_digest"] == store.model_digest(sd)
    assert ".metadata" in m["files"] and any(f.endswith(".distcp") for f in m["files"])
    assert not store.staging_dir(d).exists()


def test_digest_covers_name_dtype_shape_and_bytes():
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    base = store.model_digest(a)
    assert store.model_digest({"w": a["w"].clone()}) == base
    assert store.model_digest({"v": a["w"]}) != base
    assert store.model_digest({"w": a["w"].reshape(3, 2)}) != base
    assert store.model_digest({"w": a["w"].view(torch.int32)}) != base
    flipped = a["w"].clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    assert store.model_digest({"w": flipped}) != base
    # non-contiguous views hash as their values, not their storage
    assert store.model_digest({"w": a["w"].t().contiguous().t()}) == base


def test_bit_flip_is_named(saved, tmp_path):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(saved[0], d)
    data = sorted(p for p in d.iterdir() if p.suffix == ".distcp")[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(FourdError, match=rf"{data.name}: SHA-256 differs"):
        store.verify(d)
    with pytest.raises(FourdError, match=data.name):
        store.load_model_checkpoint(d)


def test_missing_file_and_missing_manifest(saved, tmp_path):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(saved[0], d)
    (d / ".metadata").unlink()
    with pytest.raises(FourdError, match=r"\.metadata: missing"):
        store.verify(d)
    (d / "manifest.json").unlink()
    with pytest.raises(FourdError, match="no manifest.json; not a fourd checkpoint"):
        store.load_model_checkpoint(d)


def test_foreign_manifest_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(FourdError, match="format is not 'fourd-checkpoint'"):
        store.verify(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(FourdError, match="not valid JSON"):
        store.verify(tmp_path)


def test_existing_destination_is_refused_and_nothing_half_written(saved):
    d, sd = saved
    before = sorted(p.name for p in d.iterdir())
    with pytest.raises(FourdError, match="already exists"):
        store.save_model_checkpoint(d, CFG, sd)
    assert sorted(p.name for p in d.iterdir()) == before


def test_failed_write_leaves_no_directory(tmp_path):
    d = tmp_path / "step-1"
    store.staging_dir(d).mkdir()  # debris of a crashed earlier attempt
    (store.staging_dir(d) / "junk").write_text("x")
    sd = {"w": torch.ones(3)}
    with pytest.raises(
        AttributeError
    ):  # fails after DCP wrote its files, while writing the manifest
        store.save_model_checkpoint(d, None, sd)
    assert list(tmp_path.iterdir()) == []
    store.save_model_checkpoint(d, CFG, sd)
    assert sorted(store.read_manifest(d)["files"]) == [".metadata", "__0_0.distcp"]


def test_newest_skips_damaged_checkpoints_and_says_so(tmp_path, capsys):
    sd = {"w": torch.ones(2)}
    for step in (5, 40, 300):
        store.save_model_checkpoint(tmp_path / "checkpoints" / f"step-{step}", CFG, sd, step=step)
    (tmp_path / "checkpoints" / "step-300" / "manifest.json").write_text("{")  # torn
    (tmp_path / "checkpoints" / "step-900").mkdir()  # no manifest
    store.staging_dir(
        tmp_path / "checkpoints" / "step-1000"
    ).mkdir()  # a save in progress: not a checkpoint
    assert store.newest(tmp_path) == tmp_path / "checkpoints" / "step-40"
    assert capsys.readouterr().err == (
        "fourd: warning: falling back to the previous complete checkpoint step-40 (skipped damaged step-900, step-300)\n"
    )
    assert store.resolve(tmp_path) == tmp_path / "checkpoints" / "step-40"
    assert store.resolve(tmp_path / "checkpoints" / "step-5") == tmp_path / "checkpoints" / "step-5"
    assert store.newest(tmp_path / "nothing") is None
    capsys.readouterr()
    for step in (5, 40):
        (tmp_path / "checkpoints" / f"step-{step}" / "manifest.json").unlink()
    with pytest.raises(
        FourdError, match="a run directory without a complete checkpoint under checkpoints/"
    ):
        store.resolve(tmp_path)
    assert capsys.readouterr().err.count("\n") == 1


def test_load_refuses_a_manifest_model_that_does_not_fit_the_tensors(saved, tmp_path):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(saved[0], d)
    m = store.read_manifest(d)
    (d / "manifest.json").unlink()
    bigger = dataclasses.replace(CFG, layers=CFG.layers * 1000)
    store.write_manifest(d, cfg=bigger, digest=m["model_digest"], step=7)
    with pytest.raises(
        FourdError, match=f"holds {CFG.params():,} model parameters, its manifest's model has"
    ):
        store.load_model_checkpoint(d)
    sd = build_model(CFG, seed=1).state_dict()
    sd["norm.bias"] = sd.pop("norm.weight")  # as many parameters, another name
    store.save_model_checkpoint(tmp_path / "renamed", CFG, sd)
    with pytest.raises(FourdError, match="tensor norm.bias does not fit its manifest's model"):
        store.load_model_checkpoint(tmp_path / "renamed")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file if unpickled


def test_metadata_pickle_cannot_run_code_even_with_a_matching_manifest(saved, tmp_path):
    import pickle
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(saved[0], d)
    marker = tmp_path / "ran"
    (d / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    m = store.read_manifest(d)
    (d / "manifest.json").unlink()
    store.write_manifest(
        d, cfg=CFG, digest=m["model_digest"], step=m["step"], layout=m["layout"]
    )  # hashes now match
    store.verify(d)
    with pytest.raises(FourdError, match=r"\.metadata: refused \(io\.open is not allowed"):
        store.load_model_checkpoint(d)
    assert not marker.exists()
