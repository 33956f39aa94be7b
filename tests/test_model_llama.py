import torch

from fourd.model.config import PRESETS, ModelConfig, parse_model_spec
from fourd.model.llama import Attention, apply_rope, build_model, rope_table


def test_preset_parameter_counts_on_meta():
    want = {
        "llama3-8b": 8_030_261_248,
        "llama3-70b": 70_553_706_496,
        "llama3-405b": 405_853_388_800,
    }
    for name, n in want.items():
        model = build_model(PRESETS[name], device="meta")
        assert sum(p.numel() for p in model.parameters()) == n
        assert PRESETS[name].params() == n


def test_small_presets_match_their_formula():
    for name in ("debug", "small"):
        model = build_model(PRESETS[name], seed=0)
        assert sum(p.numel() for p in model.parameters()) == PRESETS[name].params()


def test_flops_per_token_of_the_debug_preset():
    # 218K parameters, 16,384 of them the input embedding; 4 layers of 46,208 parameters, 4 heads of 16, 256 tokens.
    # PaLM (Chowdhery et al. 2022, app. B): 6·(217,664 − 16,384) + 12·4·4·16·256 = 1,207,680 + 786,432
    cfg = PRESETS["debug"]
    assert cfg.flops_per_token(256) == cfg.flops_per_token(256, "selective") == 1_994_112
    # full recomputation runs each layer's forward again: 2·4·46,208 + 4·4·4·16·256 = 369,664 + 262,144 more
    assert cfg.flops_per_token(256, "full") == 1_994_112 + 631_808


def test_rope_rotates_pairs_and_keeps_norms():
    cos, sin = rope_table(8, torch.arange(5), 500_000.0)
    assert cos.shape == sin.shape == (5, 4)
    x = torch.randn(2, 5, 3, 8)
    y = apply_rope(x, cos, sin)
    assert y.shape == x.shape
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated
    # the first pair turns by exactly position × θ^0 = position radians
    a, b = x[0, 3, 0, 0], x[0, 3, 0, 1]
    torch.testing.assert_close(
        y[0, 3, 0, 0], a * torch.cos(torch.tensor(3.0)) - b * torch.sin(torch.tensor(3.0))
    )


def test_rope_is_relative():
    """q·k after rotation depends on the distance between positions only."""
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq, pk):
        cq, sq = rope_table(16, torch.tensor([pq]), 500_000.0)
        ck, sk = rope_table(16, torch.tensor([pk]), 500_000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), rtol=1e-5, atol=1e-5)


def test_gqa_shapes_and_equivalence_to_repeated_heads():
    cfg = ModelConfig(layers=1, dim=32, ffn=64, heads=4, kv_heads=2, vocab=16)
    att = Attention(cfg)
    assert (
        att.wq.weight.shape == (32, 32)
        and att.wk.weight.shape == (16, 32)
        and att.wv.weight.shape == (16, 32)
    )
    x = torch.randn(2, 6, 32)
    cos, sin = rope_table(8, torch.arange(6), 500_000.0)
    out = att(x, cos, sin)
    assert out.shape == (2, 6, 32)
    # the same attention written as multi-head attention with each KV head repeated for its 2 query heads
    mha_cfg = ModelConfig(layers=1, dim=32, ffn=64, heads=4, kv_heads=4, vocab=16)
    mha = Attention(mha_cfg)
    with torch.no_grad():
        mha.wq.weight.copy_(att.wq.weight)
        mha.wo.weight.copy_(att.wo.weight)
        mha.wk.weight.copy_(att.wk.weight.view(2, 8, 32).repeat_interleave(2, 0).reshape(32, 32))
        mha.wv.weight.copy_(att.wv.weight.view(2, 8, 32).repeat_interleave(2, 0).reshape(32, 32))
    torch.testing.assert_close(mha(x, cos, sin), out)


def test_causality_and_deterministic_init():
    cfg = PRESETS["debug"]
    m1, m2 = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    assert not torch.equal(build_model(cfg, seed=4).output.weight, m1.output.weight)
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    torch.testing.assert_close(
        m1(x)[0, :8], m1(y)[0, :8]
    )  # changing later tokens never changes earlier logits


def test_model_spec_parsing():
    cfg = parse_model_spec("layers=2,dim=64,ffn=128,heads=4,kv_heads=2,vocab=100,mlp=gelu")
    assert (cfg.layers, cfg.head_dim, cfg.mlp) == (2, 16, "gelu")
    assert (
        cfg.params()
        == 2 * (64 * 64 * 2 + 2 * 64 * 32 + 2 * 64 * 128 + 4 * 64) + 2 * 100 * 64 + 2 * 64
    )
