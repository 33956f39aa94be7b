"""Conversion against transformers itself, on a tiny random Llama with GQA and untied embeddings."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fourd.ckpt import store
from fourd.cli import main
from fourd.errors import FourdError
from fourd.hf import convert
from fourd.hf.inference import generate, load_model

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64]


def tiny_hf(tie=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    m = tiny_hf()
    m.save_pretrained(d / "hf", safe_serialization=True)
    convert.hf_to_fourd(d / "hf", d / "fd")
    return d, m


def hf_tensors(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_rotary_permutation_is_exact_and_inverse():
    one_head = torch.arange(8.0)[:, None]  # head_dim 8: pairs (0,1) (2,3) (4,5) (6,7)
    assert convert.interleaved_to_halves(one_head, 1).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    w = torch.randn(4 * 16, 64, dtype=torch.bfloat16)
    back = convert.interleaved_to_halves(convert.interleaved_to_halves(w, 4), 4, inverse=True)
    assert back.dtype == torch.bfloat16 and torch.equal(back, w)


def test_names_match_transformers(hf_dir):
    d, m = hf_dir
    cfg, _ = store.load_model_checkpoint(d / "fd")
    assert sorted(map(convert.hf_name, store.shapes(cfg))) == sorted(m.state_dict())


def test_imported_logits_equal_transformers(hf_dir):
    d, m = hf_dir
    model, _ = load_model(d / "fd")
    assert (
        model.cfg.kv_heads,
        model.cfg.heads,
        model.cfg.rope_theta,
        model.cfg.norm_eps,
        model.cfg.max_seq,
    ) == (
        2,
        4,
        500000.0,
        1e-5,
        256,
    )
    ids = torch.tensor([PROMPT * 4])
    with torch.no_grad():
        want = m(ids).logits
        got = model(ids)
    assert (got - want).abs().max().item() <= 1e-5


def test_greedy_ids_equal_transformers(hf_dir):
    d, m = hf_dir
    model, _ = load_model(d / "fd")
    want = m.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, pad_token_id=0)[
        0, len(PROMPT) :
    ]
    assert generate(model, PROMPT, 24, greedy=True, stop_ids=[2]) == want.tolist()


def test_export_then_reimport_is_bit_exact(hf_dir, tmp_path):
    d, _ = hf_dir
    convert.fourd_to_hf(d / "fd", tmp_path / "hf2")
    a, b = hf_tensors(d / "hf"), hf_tensors(tmp_path / "hf2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    convert.hf_to_fourd(tmp_path / "hf2", tmp_path / "fd2")
    assert (
        store.read_manifest(tmp_path / "fd2")["model_digest"]
        == store.read_manifest(d / "fd")["model_digest"]
    )
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert (config["eos_token_id"], config["num_key_value_heads"], config["rope_theta"]) == (
        2,
        2,
        500000.0,
    )


def test_bf16_stays_bf16_through_sharded_round_trip(tmp_path):
    m = tiny_hf(dtype=torch.bfloat16, seed=1)
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.hf_to_fourd(tmp_path / "hf", tmp_path / "fd")
    _, sd = store.load_model_checkpoint(tmp_path / "fd")
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    convert.fourd_to_hf(tmp_path / "fd", tmp_path / "hf2", shard_bytes=60_000)
    index = json.loads((tmp_path / "hf2" / convert.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == len(list((tmp_path / "hf2").glob("*.safetensors"))) > 2
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf2"
    )  # reads the sharded index
    assert back.dtype == torch.bfloat16
    a, b = m.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    convert.hf_to_fourd(tmp_path / "hf2", tmp_path / "fd2")  # sharded import
    assert (
        store.read_manifest(tmp_path / "fd2")["model_digest"]
        == store.read_manifest(tmp_path / "fd")["model_digest"]
    )


def test_tied_embeddings_import_as_a_copy(tmp_path):
    m = tiny_hf(tie=True, seed=2)
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.hf_to_fourd(tmp_path / "hf", tmp_path / "fd")
    model, _ = load_model(tmp_path / "fd")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert (model(ids) - m(ids).logits).abs().max().item() <= 1e-5


def test_fourd_checkpoint_loads_in_transformers(tmp_path):
    from fourd.model.config import get_preset
    from fourd.model.llama import build_model

    cfg = get_preset("debug")
    model = build_model(cfg, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, cfg.vocab, (4, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # a few real updates, so the weights are not the initial ones
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    store.save_model_checkpoint(tmp_path / "fd", cfg, model.state_dict(), step=3)
    assert (
        main(
            ["convert", "--from", "fourd", str(tmp_path / "fd"), "--to", "hf", str(tmp_path / "hf")]
        )
        == 0
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_key_value_heads == 2 and not hf.config.tie_word_embeddings
    with torch.no_grad():
        assert (hf(x).logits - model.eval()(x)).abs().max().item() <= 1e-5


# ---- malformed inputs: exit 2 with one line naming the tensor or field --------------------------------


def _convert_fails(capsys, src, dst):
    code = main(["convert", "--from", "hf", str(src), "--to", "fourd", str(dst)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert not dst.exists()
    return err


def _broken_copy(hf_dir, tmp_path, edit_config=None, edit_tensors=None):
    src = tmp_path / "broken"
    src.mkdir()
    config = json.loads((hf_dir[0] / "hf" / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (src / "config.json").write_text(json.dumps(config))
    tensors = hf_tensors(hf_dir[0] / "hf")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(src / "model.safetensors"))
    return src


def test_missing_tensor_is_named(hf_dir, tmp_path, capsys):
    src = _broken_copy(
        hf_dir, tmp_path, edit_tensors=lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")
    )
    assert "tensor model.layers.1.self_attn.k_proj.weight missing" in _convert_fails(
        capsys, src, tmp_path / "out"
    )


def test_wrong_shape_is_named(hf_dir, tmp_path, capsys):
    def shrink(t):
        t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.2.mlp.up_proj.weight"][:100]

    src = _broken_copy(hf_dir, tmp_path, edit_tensors=shrink)
    err = _convert_fails(capsys, src, tmp_path / "out")
    assert (
        "tensor model.layers.2.mlp.up_proj.weight has shape [100, 64]; config.json implies [160, 64]"
        in err
    )


def test_unexpected_tensor_is_named(hf_dir, tmp_path, capsys):
    def add_bias(t):
        t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    src = _broken_copy(hf_dir, tmp_path, edit_tensors=add_bias)
    assert "tensor model.layers.0.self_attn.q_proj.bias is not part of" in _convert_fails(
        capsys, src, tmp_path / "out"
    )


@pytest.mark.parametrize(
    "edit, needle",
    [
        (
            lambda c: c.update(architectures=["MistralForCausalLM"]),
            "architecture 'MistralForCausalLM' is not supported",
        ),
        (
            lambda c: c.update(
                rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
            ),
            "field 'rope_parameters' = {'rope_type': 'llama3', 'rope_theta': 500000.0, 'factor': 8.0} is not supported",
        ),
        (
            lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "field 'rope_scaling' = {'rope_type': 'llama3'",
        ),
        (
            lambda c: c.update(rms_norm_eps="small"),
            "field 'rms_norm_eps' = 'small' is not a positive number",
        ),
        (lambda c: c.pop("hidden_size"), "field 'hidden_size' = None is not a positive integer"),
        (
            lambda c: c.update(num_attention_heads=0),
            "field 'num_attention_heads' = 0 is not a positive integer",
        ),
        (
            lambda c: c.update(num_key_value_heads=3),
            "model.heads = 4 must be a multiple of model.kv_heads = 3",
        ),
        (lambda c: c.update(hidden_act="gelu"), "field 'hidden_act' = 'gelu' is not supported"),
    ],
)
def test_bad_config_field_is_named(hf_dir, tmp_path, capsys, edit, needle):
    src = _broken_copy(hf_dir, tmp_path, edit_config=edit)
    assert needle in _convert_fails(capsys, src, tmp_path / "out")


def test_pickle_checkpoint_is_refused(tmp_path, capsys, hf_dir):
    src = tmp_path / "bin"
    src.mkdir()
    (src / "config.json").write_text((hf_dir[0] / "hf" / "config.json").read_text())
    (src / "pytorch_model.bin").write_bytes(b"not read")
    assert "pytorch_model.bin is a pickle" in _convert_fails(capsys, src, tmp_path / "out")


def test_export_of_a_damaged_checkpoint_names_the_file(hf_dir, tmp_path, capsys):
    import shutil

    src = tmp_path / "fd"
    shutil.copytree(hf_dir[0] / "fd", src)
    (src / "__0_0.distcp").write_bytes(b"\0" * 10)
    code = main(["convert", "--from", "fourd", str(src), "--to", "hf", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert (
        code == 2
        and "__0_0.distcp: 10 bytes, manifest says" in err
        and not (tmp_path / "out").exists()
    )


def test_load_hf_gives_fourd_names_in_float32(tmp_path):
    m = tiny_hf(dtype=torch.bfloat16, seed=3)
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg, sd = convert.load_weights(tmp_path / "hf")
    assert sorted(sd) == sorted(store.shapes(cfg)) and {t.dtype for t in sd.values()} == {
        torch.float32
    }
    convert.hf_to_fourd(tmp_path / "hf", tmp_path / "fd")
    _, kept = store.load_model_checkpoint(tmp_path / "fd")  # the checkpoint keeps bfloat16
    assert all(torch.equal(sd[k], kept[k].float()) for k in sd)


def test_export_carries_the_runs_tokenizer_file_with_the_usual_mode(hf_dir, tmp_path):
    import base64
    import os

    from fourd.data.tokenizer import load_tokenizer

    bpe = tmp_path / "llama.bpe"
    bpe.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    _, sd = store.load_model_checkpoint(hf_dir[0] / "fd")
    cfg = store.model_config("test", store.read_manifest(hf_dir[0] / "fd")["model"])
    data = {"path": "", "tokenizer": str(bpe), "identity": load_tokenizer(str(bpe)).identity()}
    store.save_model_checkpoint(tmp_path / "fd", cfg, sd, extra={"train": {"data": data}})
    old = os.umask(0o022)
    try:
        assert (
            main(
                [
                    "convert",
                    "--from",
                    "fourd",
                    str(tmp_path / "fd"),
                    "--to",
                    "hf",
                    str(tmp_path / "hf"),
                ]
            )
            == 0
        )
    finally:
        os.umask(old)
    out = tmp_path / "hf"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    assert (out / "tokenizer.model").read_bytes() == bpe.read_bytes()
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
    bpe.write_text(
        bpe.read_text().replace(" 255\n", " 255\n\n")
    )  # same ranks, other bytes: another file
    assert (
        main(
            [
                "convert",
                "--from",
                "fourd",
                str(tmp_path / "fd"),
                "--to",
                "hf",
                str(tmp_path / "hf2"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "hf2").exists()


@pytest.mark.parametrize("mb", ["0", "-5"])
def test_shard_mb_below_one_is_refused(hf_dir, tmp_path, capsys, mb):
    assert (
        main(
            [
                "convert",
                "--from",
                "fourd",
                str(hf_dir[0] / "fd"),
                "--to",
                "hf",
                str(tmp_path / "o"),
                "--shard-mb",
                mb,
            ]
        )
        == 2
    )
    assert (
        capsys.readouterr().err
        == f"fourd: error: --shard-mb {mb} must be at least 1 (MB per safetensors file)\n"
    )
    assert not (tmp_path / "o").exists()


def test_an_index_naming_files_outside_the_folder_is_refused(hf_dir, tmp_path, capsys):
    src = _broken_copy(hf_dir, tmp_path)
    outside = tmp_path / "outside.safetensors"
    (src / "model.safetensors").rename(outside)
    names = sorted(hf_tensors(hf_dir[0] / "hf"))
    (src / convert.INDEX).write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "../outside.safetensors")})
    )
    err = _convert_fails(capsys, src, tmp_path / "out")
    assert f"names '../outside.safetensors', which is not a file inside {src}" in err


# ---- property tests: any config.json or index ends in a model or one FourdError line ------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
HF_KEYS = st.sampled_from(
    [
        "architectures",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ]
    + [
        "intermediate_size",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "hidden_act",
    ]
    + ["max_position_embeddings", "tie_word_embeddings", "attention_bias"]
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edits=st.dictionaries(HF_KEYS, JSON, max_size=3))
def test_any_config_json_is_a_model_or_one_line(hf_dir, tmp_path, edits):
    (tmp_path / "config.json").write_text(
        json.dumps({**json.loads((hf_dir[0] / "hf" / "config.json").read_text()), **edits})
    )
    try:
        cfg, _ = convert.read_hf_config(tmp_path)
        assert cfg.params() > 0
    except FourdError as e:
        assert str(e) and "\n" not in str(e)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    index=JSON
    | st.dictionaries(st.just("weight_map"), st.dictionaries(st.text(max_size=8), JSON, max_size=3))
)
def test_any_index_is_read_or_one_line(tmp_path, index):
    (tmp_path / convert.INDEX).write_text(json.dumps(index))
    (tmp_path / "a.safetensors").write_bytes(b"not safetensors")
    try:
        convert.read_hf_tensors(tmp_path)
    except FourdError as e:
        assert str(e) and "\n" not in str(e)
