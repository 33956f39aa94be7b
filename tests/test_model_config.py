"""fourd.model.config by hand: a model's checks, its defaults and presets, `--model-spec`'s parsing and
refusals, `with_overrides`' head dimension, and the parameter counts of the debug model worked out term by
term (the planner and the trainer both read them)."""

from __future__ import annotations

import pytest

from fourd.errors import FourdError
from fourd.model.config import ModelConfig, get_preset, parse_model_spec, with_overrides

SHAPE = dict(layers=2, dim=64, ffn=176, heads=4, kv_heads=2, vocab=256)


def test_the_defaults_are_llama_3s():
    """RMSNorm ε 1e-5 and RoPE θ 500,000 (Llama 3's released configs), 8,192 positions, SwiGLU; the head
    dimension dim / heads."""
    cfg = ModelConfig(**SHAPE)
    assert (cfg.norm_eps, cfg.rope_theta, cfg.max_seq, cfg.mlp, cfg.head_dim) == (
        1e-5,
        500_000.0,
        8192,
        "swiglu",
        16,
    )


def test_the_test_presets_are_pinned():
    assert get_preset("debug") == ModelConfig(
        layers=4, dim=64, ffn=176, heads=4, kv_heads=2, vocab=256, max_seq=256
    )
    assert get_preset("small") == ModelConfig(
        layers=8, dim=256, ffn=704, heads=8, kv_heads=4, vocab=256, max_seq=1024
    )


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("layers", 0, "model.layers = 0 must be a positive integer"),
        ("dim", -64, "model.dim = -64 must be a positive integer"),
        ("vocab", True, "model.vocab = True must be a positive integer"),
        ("ffn", 1.5, "model.ffn = 1.5 must be a positive integer"),
        ("head_dim", -2, "model.head_dim = -2 must be a positive integer"),
        ("head_dim", 5, "model head_dim = 5 must be even for RoPE"),
        ("head_dim", 3, "model head_dim = 3 must be even for RoPE"),
        ("kv_heads", 3, "model.heads = 4 must be a multiple of model.kv_heads = 3"),
        ("mlp", "relu", "model.mlp = 'relu': allowed values are swiglu, gelu, gelu_new"),
        ("tied_embeddings", 1, "model.tied_embeddings = 1 must be true or false"),
    ],
)
def test_a_model_is_refused_in_one_line(field, value, message):
    with pytest.raises(FourdError) as e:
        ModelConfig(**(SHAPE | {field: value}))
    assert str(e.value) == message


def test_an_even_head_dimension_of_its_own_is_kept():
    assert ModelConfig(**SHAPE, head_dim=6).head_dim == 6
    assert ModelConfig(**SHAPE, head_dim=2).head_dim == 2


def test_the_debug_models_parameters_term_by_term():
    """4 layers of dim 64, 4 query heads and 2 K/V heads of 16, FFN 176, vocabulary 256, untied output."""
    cfg = get_preset("debug")
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # wq, wk, wv, wo
    mlp = 3 * 64 * 176  # w1, w3, w2
    layer = attention + mlp + 2 * 64  # and two RMSNorm weights
    assert cfg.layer_params() == layer
    assert cfg.embedding_params() == 256 * 64
    assert cfg.params() == 4 * layer + 2 * 256 * 64 + 64  # the final norm
    assert cfg.non_embedding_params() == 4 * layer + 64
    gpt = with_overrides(cfg, mlp="gelu", kv_heads=4)
    gpt_layer = (
        4 * 64 * 64 + 2 * 64 * 176 + 4 * 64
    )  # Q K V O, two MLP matrices, two LayerNorms with biases
    assert gpt.layer_params() == gpt_layer
    assert (
        gpt.params() == 4 * gpt_layer + 2 * 256 * 64 + 2 * 64
    )  # the final LayerNorm's weight and bias


def test_a_model_spec_reads_each_key_once_as_a_positive_integer():
    spec = parse_model_spec("layers=2, dim=64,ffn=176,heads=4,vocab=256,")
    assert spec == ModelConfig(
        layers=2, dim=64, ffn=176, heads=4, kv_heads=4, vocab=256
    )  # kv_heads: heads
    assert parse_model_spec("layers=1,dim=64,ffn=1,heads=1,vocab=1,mlp=gelu").mlp == "gelu"
    keys = "dim, ffn, head_dim, heads, kv_heads, layers, mlp, tied, vocab"
    for spec, message in [
        (
            "layers=2,dim=64,ffn=176,heads=4,vocab=256,bias=1",
            f"--model-spec: bad item 'bias=1'; keys are {keys} as key=value",
        ),
        (
            "layers=2,dim=64,ffn=176,heads=4,vocab",
            f"--model-spec: bad item 'vocab'; keys are {keys} as key=value",
        ),
        (
            "layers=2,dim=64,ffn=176,heads=4,vocab=256,dim=32",
            "--model-spec: dim is given twice; give each key once",
        ),
        (
            "layers=two,dim=64,ffn=176,heads=4,vocab=256",
            "--model-spec: layers='two' must be an integer",
        ),
        (
            "layers=0,dim=64,ffn=176,heads=4,vocab=256",
            "--model-spec: layers=0 must be a positive integer",
        ),
        ("layers=2,dim=64,heads=4", "--model-spec lacks ffn, vocab"),
        (
            "layers=2,dim=64,ffn=176,heads=4,vocab=256,tied=yes",
            "--model-spec: tied='yes' must be 1 (tied) or 0 (untied)",
        ),
    ]:
        with pytest.raises(FourdError) as e:
            parse_model_spec(spec)
        assert str(e.value) == message, spec


def test_overrides_recompute_the_head_dimension_unless_given():
    cfg = ModelConfig(**SHAPE)  # head_dim 16
    assert with_overrides(cfg, dim=128).head_dim == 32
    assert with_overrides(cfg, heads=8, kv_heads=2).head_dim == 8
    assert with_overrides(cfg, dim=128, head_dim=16).head_dim == 16
    assert with_overrides(cfg, ffn=256).head_dim == 16
    pinned = ModelConfig(**SHAPE, head_dim=8)
    assert with_overrides(pinned, layers=3).head_dim == 8  # neither dim nor heads: its own is kept


def test_counts_of_a_model_whose_terms_share_bits():
    """Sums whose terms share binary digits (so no `|` or `^` passes for `+`): 1 layer of dim 12, 3 heads of 4,
    FFN 5, vocabulary 7."""
    cfg = ModelConfig(layers=1, dim=12, ffn=5, heads=3, kv_heads=3, vocab=7)
    assert cfg.layer_matrix_params() == 4 * 12 * 12 + 3 * 12 * 5  # 756
    assert cfg.layer_params() == 756 + 2 * 12  # 780: 756 and 24 share the 16s digit
    assert cfg.params() == 780 + 2 * 7 * 12 + 12  # 960: 948 and 12 share the 4s digit


def test_a_tied_model_counts_its_embedding_matrix_once_and_its_flops_alike():
    """tied=1: the output projection is the input embedding's matrix, so the model holds V·h fewer
    parameters; its FLOPs do not change (the output projection's matmul runs either way)."""
    untied = parse_model_spec("layers=2,dim=64,ffn=176,heads=4,vocab=256,tied=0")
    tied = parse_model_spec("layers=2,dim=64,ffn=176,heads=4,vocab=256,tied=1")
    assert (untied.tied_embeddings, tied.tied_embeddings) == (False, True)
    assert untied == ModelConfig(layers=2, dim=64, ffn=176, heads=4, kv_heads=4, vocab=256)
    assert untied.params() - tied.params() == 256 * 64
    assert (
        tied.non_embedding_params()
        == untied.non_embedding_params()
        == untied.params() - 2 * 256 * 64
    )
    assert tied.flops_per_token(128) == untied.flops_per_token(128)
    assert tied.flops_per_token(128, "full") == untied.flops_per_token(128, "full")
