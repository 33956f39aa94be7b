"""Conversion against transformers itself, on a tiny random Llama with GQA and untied embeddings."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fourd.ckpt import store
from fourd.cli import main
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
    back = convert.halves_to_interleaved(convert.interleaved_to_halves(w, 4), 4)
    assert back.dtype == torch.bfloat16 and torch.equal(back, w)


def test_names_match_transformers(hf_dir):
    d, m = hf_dir
    cfg, _ = store.load_model_checkpoint(d / "fd")
    assert sorted(map(convert.hf_name, store.shapes(cfg))) == sorted(m.state_dict())


def test_imported_logits_equal_transformers(hf_dir):
    d, m = hf_dir
    model, _ = load_model(d / "fd")
    assert (model.cfg.kv_heads, model.cfg.heads, model.cfg.rope_theta, model.cfg.norm_eps, model.cfg.max_seq) == (
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
    want = m.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(PROMPT) :]
    assert generate(model, PROMPT, 24, greedy=True, stop_ids=[2]) == want.tolist()


def test_export_then_reimport_is_bit_exact(hf_dir, tmp_path):
    d, _ = hf_dir
    convert.fourd_to_hf(d / "fd", tmp_path / "hf2")
    a, b = hf_tensors(d / "hf"), hf_tensors(tmp_path / "hf2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    convert.hf_to_fourd(tmp_path / "hf2", tmp_path / "fd2")
    assert store.read_manifest(tmp_path / "fd2")["model_digest"] == store.read_manifest(d / "fd")["model_digest"]
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert (config["eos_token_id"], config["num_key_value_heads"], config["rope_theta"]) == (2, 2, 500000.0)


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
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf2")  # reads the sharded index
    assert back.dtype == torch.bfloat16
    a, b = m.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    convert.hf_to_fourd(tmp_path / "hf2", tmp_path / "fd2")  # sharded import
    assert store.read_manifest(tmp_path / "fd2")["model_digest"] == store.read_manifest(tmp_path / "fd")["model_digest"]


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
    assert main(["convert", "--from", "fourd", str(tmp_path / "fd"), "--to", "hf", str(tmp_path / "hf")]) == 0
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
    src = _broken_copy(hf_dir, tmp_path, edit_tensors=lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    assert "tensor model.layers.1.self_attn.k_proj.weight missing" in _convert_fails(capsys, src, tmp_path / "out")


def test_wrong_shape_is_named(hf_dir, tmp_path, capsys):
    def shrink(t):
        t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.2.mlp.up_proj.weight"][:100]

    src = _broken_copy(hf_dir, tmp_path, edit_tensors=shrink)
    err = _convert_fails(capsys, src, tmp_path / "out")
    assert "tensor model.layers.2.mlp.up_proj.weight has shape [100, 64]; config.json implies [160, 64]" in err


def test_unexpected_tensor_is_named(hf_dir, tmp_path, capsys):
    def add_bias(t):
        t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    src = _broken_copy(hf_dir, tmp_path, edit_tensors=add_bias)
    assert "tensor model.layers.0.self_attn.q_proj.bias is not part of" in _convert_fails(capsys, src, tmp_path / "out")


@pytest.mark.parametrize(
    "edit, needle",
    [
        (
            lambda c: c.update(architectures=["MistralForCausalLM"]),
            "architecture 'MistralForCausalLM' is not supported",
        ),
        (
            lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
            "field 'rope_parameters' = {'rope_type': 'llama3', 'rope_theta': 500000.0, 'factor': 8.0} is not supported",
        ),
        (
            lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "field 'rope_scaling' = {'rope_type': 'llama3'",
        ),
        (lambda c: c.update(rms_norm_eps="small"), "field 'rms_norm_eps' = 'small' is not a number"),
        (lambda c: c.pop("hidden_size"), "field 'hidden_size' missing"),
        (lambda c: c.update(num_attention_heads=0), "field 'num_attention_heads' missing or not a positive integer"),
        (lambda c: c.update(num_key_value_heads=3), "model.heads = 4 must be a multiple of model.kv_heads = 3"),
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
    assert code == 2 and "__0_0.distcp: 10 bytes, manifest says" in err and not (tmp_path / "out").exists()
