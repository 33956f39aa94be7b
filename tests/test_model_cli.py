"""`fourd model info`: exact parameter counts of the presets, on the meta device, as text and JSON."""

import json

import pytest
from conftest import run_fourd

# Total parameters of Meta's released checkpoints (the Hugging Face model cards' safetensors totals).
RELEASED = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_parameter_counts_equal_the_released_models(preset):
    code, out, err = run_fourd("model", "info", preset, "--json")
    assert code == 0 and err == ""
    info = json.loads(out)
    assert list(info) == [
        "preset",
        "params",
        "layers",
        "dim",
        "ffn",
        "heads",
        "kv_heads",
        "vocab",
        "head_dim",
        "norm_eps",
        "rope_theta",
        "max_seq",
        "mlp",
        "tied_embeddings",
        "non_embedding_params",
        "flops_per_token_at_max_seq",
    ]
    assert info["params"] == RELEASED[preset]
    embeddings = info["vocab"] * info["dim"]  # input and output, untied
    assert info["non_embedding_params"] == RELEASED[preset] - 2 * embeddings
    attention = 12 * info["layers"] * info["heads"] * info["head_dim"] * info["max_seq"]
    assert info["flops_per_token_at_max_seq"] == 6 * (RELEASED[preset] - embeddings) + attention


def test_text_output():
    code, out, err = run_fourd("model", "info", "llama3-8b")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[1] == "params                      8,030,261,248 (8.03B)"
    assert "non_embedding_params        6,979,588,096 (6.98B)" in lines
