"""Layout parsing, the rank formula, and every refusal of an impossible layout (pure Python)."""

import pytest

from fourd.errors import FourdError
from fourd.model.config import ModelConfig, get_preset, with_overrides
from fourd.parallel.layout import Layout, parse_layout, validate_layout

DEBUG = get_preset("debug")  # 4 layers, 4 heads, 2 KV heads, FFN 176, vocab 256
L405 = get_preset("llama3-405b")


def test_parse_and_print_round_trip():
    lay = parse_layout(" tp=2, pp=2 ,dp=3")
    assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.world) == (2, 1, 2, 3, 12)
    assert str(lay) == "tp=2,cp=1,pp=2,dp=3"
    assert parse_layout(str(lay)) == lay
    assert parse_layout("dp=1") == Layout() and Layout().world == 1


def test_rank_formula_is_tp_innermost():
    lay = Layout(tp=8, cp=16, pp=16, dp=8)  # Llama 3's long-context layout, 16,384 GPUs
    assert lay.world == 16384
    assert lay.rank(tp=3, cp=2, pp=5, dp=7) == 3 + 8 * (2 + 16 * (5 + 16 * 7)) == 14995
    assert lay.coords(14995) == {"tp": 3, "cp": 2, "pp": 5, "dp": 7}
    small = Layout(tp=2, cp=2, pp=2, dp=2)
    for r in range(small.world):
        assert small.rank(**small.coords(r)) == r
    assert small.coords(1) == {"tp": 1, "cp": 0, "pp": 0, "dp": 0}
    assert small.coords(2) == {"tp": 0, "cp": 1, "pp": 0, "dp": 0}
    assert small.coords(4) == {"tp": 0, "cp": 0, "pp": 1, "dp": 0}
    assert small.coords(8 - 1) == {"tp": 1, "cp": 1, "pp": 1, "dp": 0}


@pytest.mark.parametrize(
    "text, message",
    [
        ("tp=2,xx=3", r"bad item 'xx=3'; write key=value with keys tp, cp, pp, dp"),
        ("tp", r"bad item 'tp'"),
        ("tp=0", r"tp=0: each degree must be a positive integer"),
        ("dp=-2", r"dp=-2: each degree must be a positive integer"),
        ("pp=1.5", r"pp='1.5' must be a positive integer"),
        ("cp=two", r"cp='two' must be a positive integer"),
        ("tp=2,tp=4", r"tp is given twice"),
    ],
)
def test_malformed_layouts_are_refused(text, message):
    with pytest.raises(FourdError, match=message):
        parse_layout(text)


def test_a_valid_layout_passes():
    validate_layout(Layout(tp=2, pp=2, dp=2), DEBUG, seq=64, global_batch=8, microbatches=2, world=8)
    # Llama 3 405B at 16,384 GPUs, long context: 8 × 16 × 16 × 8, 16 sequences per replica (brief.md §3).
    validate_layout(
        Layout(tp=8, cp=16, pp=16, dp=8),
        L405,
        seq=131072,
        global_batch=128,
        microbatches=16,
        world=16384,
        virtual_stages=7,
    )


@pytest.mark.parametrize(
    "layout, kw, message",
    [
        (Layout(tp=2, dp=2), dict(world=8), r"needs 4 ranks \(tp·cp·pp·dp\) but 8 processes run"),
        (Layout(tp=3), {}, r"heads \(4\) cannot be cut into tp=3 equal parts: choose tp among 1, 2"),
        (Layout(tp=4), {}, r"KV heads \(2\) cannot be cut into tp=4 equal parts: choose tp among 1, 2"),
        (Layout(pp=5), {}, r"makes 5 pipeline stages but the model has 4 layers"),
        (Layout(pp=2), dict(virtual_stages=3), r"pp=2 with 3 virtual stage\(s\) makes 6 pipeline stages"),
        (Layout(cp=3), {}, r"sequence length 64 is not divisible by 2·cp = 6"),
        (Layout(dp=3), {}, r"global batch 8 sequences is not divisible by dp × microbatches = 3 × 1 = 3"),
        (Layout(dp=2), dict(microbatches=3), r"dp × microbatches = 2 × 3 = 6"),
        (Layout(dp=4), dict(global_batch=8, hsdp_replicate=3), r"HSDP replicas = 3 must divide dp=4 .*one of 1, 2, 4$"),
    ],
)
def test_impossible_layouts_are_refused_with_the_reason(layout, kw, message):
    args = dict(seq=64, global_batch=8, microbatches=1) | kw
    with pytest.raises(FourdError, match=message):
        validate_layout(layout, DEBUG, **args)


def test_sequence_parallelism_needs_whole_token_shards():
    kv4 = with_overrides(DEBUG, kv_heads=4)
    validate_layout(Layout(tp=4), kv4, seq=66, global_batch=1)
    with pytest.raises(FourdError, match=r"cuts each rank's 66 tokens into tp=4 parts: choose a sequence length"):
        validate_layout(Layout(tp=4), kv4, seq=66, global_batch=1, sequence_parallel=True)


def test_ffn_and_vocab_must_split_evenly():
    odd_ffn = ModelConfig(layers=2, dim=64, ffn=170, heads=4, kv_heads=4, vocab=256)
    with pytest.raises(
        FourdError, match=r"FFN width \(170\) cannot be cut into tp=4 equal parts: choose tp among 1, 2$"
    ):
        validate_layout(Layout(tp=4), odd_ffn, seq=8, global_batch=1)
    odd = ModelConfig(layers=2, dim=64, ffn=176, heads=4, kv_heads=4, vocab=257)
    with pytest.raises(FourdError, match=r"vocabulary \(257\) cannot be cut into tp=2"):
        validate_layout(Layout(tp=2), odd, seq=8, global_batch=1)
