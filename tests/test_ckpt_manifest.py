"""The manifest is untrusted JSON: a typed schema, paths confined to the checkpoint, one line for anything wrong."""

import ast
import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fourd.ckpt import store
from fourd.cli import main
from fourd.errors import FourdError
from fourd.model.config import get_preset

CFG = get_preset("debug")
ROOT = Path(__file__).resolve().parent.parent


def _checkpoint(d: Path) -> dict:
    """A directory with one data file and a valid manifest (no tensors: the schema is all that is read)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "__0_0.distcp").write_bytes(b"tensor bytes")
    return store.write_manifest(
        d, cfg=CFG, digest="ab" * 32, step=7, layout="dp=1", extra={"train": {"seed": 0}}
    )


def _rewrite(d: Path, edit) -> None:
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _fails(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert (
        captured.out == ""
        and captured.err.count("\n") == 1
        and captured.err.startswith("fourd: error: ")
    )
    return captured.err


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(step="7"), "field 'step' = '7' is not an integer >= 0"),
        (lambda m: m.update(step=-1), "field 'step' = -1 is not an integer >= 0"),
        (lambda m: m.update(step=True), "field 'step' = True is not an integer >= 0"),
        (lambda m: m.update(layout=5), "field 'layout' = 5 is not a string"),
        (lambda m: m.update(model=[1]), "field 'model' = [1] is not an object"),
        (
            lambda m: m["model"].update(layers="4"),
            "field 'model.layers' = '4' is not an integer >= 0",
        ),
        (
            lambda m: m["model"].update(norm_eps=None),
            "field 'model.norm_eps' = None is not a finite number >= 0",
        ),
        (lambda m: m["model"].update(colour=1), "field 'model.colour' is not a model setting"),
        (
            lambda m: m["model"].update(layers=0),
            "field 'model' is not a valid model (model.layers = 0 must be",
        ),
        (
            lambda m: m["model"].pop("dim"),
            "field 'model' is not a valid model (ModelConfig.__init__() missing",
        ),
        (lambda m: m.update(model_digest="xyz"), "field 'model_digest' = 'xyz' is not a SHA-256"),
        (lambda m: m.pop("files"), "missing field 'files'; the checkpoint is damaged"),
        (
            lambda m: m.update(files={"__0_0.distcp": 12}),
            "field \"files['__0_0.distcp']\" = 12 is not an object",
        ),
        (
            lambda m: m["files"]["__0_0.distcp"].update(bytes="12"),
            "field \"files['__0_0.distcp'].bytes\" = '12'",
        ),
        (
            lambda m: m["files"]["__0_0.distcp"].update(sha256="00"),
            "field \"files['__0_0.distcp'].sha256\" = '00' is not a SHA-256",
        ),
        (
            lambda m: m["model"].update(tied_embeddings=1),
            "field 'model.tied_embeddings' = 1 is not true or false",
        ),
        (
            lambda m: m["model"].update(tied_embeddings=True),
            "model.tied_embeddings = true; a checkpoint holds fourd's Llama, whose output "
            "projection is its own matrix",
        ),
        (
            lambda m: m["model"].update(mlp="gelu"),
            "model.mlp = 'gelu'; a checkpoint holds a Llama (swiglu) model",
        ),
        (lambda m: m.update(train="x"), "field 'train' = 'x' is not an object"),
        (
            lambda m: m["train"].update(data={"tokens": "many"}),
            "field 'train.data.tokens' = 'many' is not an integer",
        ),
        (lambda m: m.update(version=2), "version 2 is not supported (this fourd reads 1)"),
        (
            lambda m: m.update(format=None),
            "format is not 'fourd-checkpoint'; not a fourd checkpoint",
        ),
    ],
)
def test_wrong_typed_fields_are_one_line_exit_2(tmp_path, capsys, edit, message):
    d = tmp_path / "step-7"
    _checkpoint(d)
    _rewrite(d, edit)
    for command in ("verify", "info"):
        assert message in _fails(capsys, "ckpt", command, str(d))


def test_files_outside_the_checkpoint_are_refused_not_hashed(tmp_path, capsys):
    d = tmp_path / "run" / "checkpoints" / "step-7"
    _checkpoint(d)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not part of any checkpoint")
    entry = {
        "bytes": outside.stat().st_size,
        "sha256": hashlib.sha256(outside.read_bytes()).hexdigest(),
    }
    for rel in ("../../../outside.txt", str(outside), "sub/../../../../outside.txt", "", "."):
        _rewrite(d, lambda m, rel=rel: m.update(files={rel: entry}))
        err = _fails(capsys, "ckpt", "verify", str(d))
        assert f"names {rel!r}, which is not a file inside {d}" in err
    (d / "link").symlink_to(outside)  # a link inside that resolves outside
    _rewrite(d, lambda m: m.update(files={"link": entry}))
    assert "names 'link', which is not a file inside" in _fails(capsys, "ckpt", "verify", str(d))


def test_a_valid_manifest_reads_and_verifies(tmp_path):
    d = tmp_path / "step-7"
    written = _checkpoint(d)
    assert store.read_manifest(d) == written == store.verify(d)


# ---- property tests: any input ends in success or one FourdError line ----------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
KEYS = st.sampled_from(
    [
        "format",
        "version",
        "step",
        "layout",
        "model",
        "model_digest",
        "files",
        "train",
        "hf_config",
        "x",
    ]
)


def _one_line(e: FourdError) -> None:
    assert str(e) and "\n" not in str(e)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    replace=st.dictionaries(KEYS, JSON, max_size=3),
    model=st.dictionaries(st.text(max_size=9), JSON, max_size=3),
)
def test_manifest_schema_never_raises_anything_else(tmp_path, replace, model):
    d = tmp_path / "step-7"
    written = _checkpoint(d)
    _rewrite(
        d,
        lambda m: (
            m.update(replace),
            m["model"].update(model) if isinstance(m.get("model"), dict) else None,
        ),
    )
    try:
        assert store.verify(d)["step"] >= 0
    except FourdError as e:
        _one_line(e)
    assert written


@settings(max_examples=200, deadline=None)
@given(spec=st.dictionaries(st.sampled_from([*CFG.to_dict(), "other"]), JSON, max_size=11))
def test_model_spec_never_raises_anything_else(spec):
    try:
        cfg = store.model_config("manifest.json", {**CFG.to_dict(), **spec})
        assert cfg.params() > 0
    except FourdError as e:
        _one_line(e)


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_manifest_bytes_are_one_line(tmp_path_factory, raw):
    d = tmp_path_factory.mktemp("m")
    (d / "manifest.json").write_bytes(raw)
    with pytest.raises(FourdError) as e:
        store.read_manifest(d)
    _one_line(e.value)


def test_ckpt_modules_import_no_cycle_and_data_imports_no_hf():
    def imports(package: str) -> dict[str, set[str]]:
        out = {}
        for f in (ROOT / "fourd" / package).glob("*.py"):
            names = set()
            for node in ast.walk(ast.parse(f.read_text())):  # function-level imports count too
                if isinstance(node, ast.ImportFrom) and node.module:
                    names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    names |= {a.name for a in node.names}
            out[f"fourd.{package}.{f.stem}"] = names
        return out

    graph = imports("ckpt")
    edges = {m: {n for n in names if n in graph and n != m} for m, names in graph.items()}
    assert (
        edges["fourd.ckpt.store"] == {"fourd.ckpt.safe_reader"}
        and edges["fourd.ckpt.safe_reader"] == set()
    )

    def reaches(start, goal, seen=()):
        return any(
            n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in edges[start]
        )

    assert [m for m in edges if reaches(m, m)] == []
    assert not any(n.startswith("fourd.hf") for names in imports("data").values() for n in names)


def test_a_manifest_of_an_older_fourd_without_tied_embeddings_is_the_same_model(tmp_path):
    """Manifests written before the model had `tied_embeddings` lack the key: they read as untied,
    the same model, and resume; another model is still named."""
    d = tmp_path / "step-7"
    _checkpoint(d)
    _rewrite(d, lambda m: m["model"].pop("tied_embeddings"))
    store.check_model(d, CFG)
    with pytest.raises(FourdError) as e:
        store.check_model(d, get_preset("small"))
    assert "holds another model: layers 4 (this run: 8)" in str(e.value)
