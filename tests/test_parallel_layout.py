"""Layout parsing, the rank formula, and every refusal of an impossible layout (pure Python)."""

import pytest
from conftest import run_fourd

from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism, check, layer_split, parse_layout, split_ok
from fourd.model.config import ModelConfig, get_preset, with_overrides

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
    check(
        DEBUG, Parallelism(layout=Layout(tp=2, pp=2, dp=2), microbatches=2), seq=64, global_seqs=8
    )
    # Llama 3 405B at 16,384 GPUs, long context: 8 × 16 × 16 × 8, 16 sequences per replica (Llama 3 paper, Table 4).
    lay = Layout(tp=8, cp=16, pp=16, dp=8)
    check(
        L405,
        Parallelism(layout=lay, schedule="interleaved", microbatches=16, virtual_stages=8),
        seq=131072,
        global_seqs=128,
    )


@pytest.mark.parametrize(
    "par, kw, message",
    [
        (
            Parallelism(layout=Layout(tp=3)),
            {},
            "tp=3 cannot cut the model's heads (4), KV heads (2), FFN width (176) and vocabulary (256) into equal "
            "parts: choose tp among 1, 2",
        ),
        (
            Parallelism(layout=Layout(pp=5)),
            {},
            "pp=5 with 1 virtual stage makes 5 pipeline stages for 4 layers: use at most 4 stages, or exactly 6 "
            "(the embedding and the output a stage each)",
        ),
        (
            Parallelism(layout=Layout(pp=2), schedule="interleaved", virtual_stages=4),
            {},
            "pp=2 with 4 virtual stages makes 8 pipeline stages for 4 layers: use at most 4 stages, or exactly 6 "
            "(the embedding and the output a stage each)",
        ),
        (
            Parallelism(layout=Layout(pp=2), virtual_stages=2),
            {},
            "2 virtual stages need the interleaved schedule (1f1b runs one stage per rank): choose the interleaved "
            "schedule or one virtual stage",
        ),
        (
            Parallelism(layout=Layout(dp=2), schedule="interleaved", virtual_stages=2),
            {},
            "2 virtual stages need a pipeline: choose pp > 1 or one virtual stage",
        ),
        (
            Parallelism(layout=Layout(cp=3)),
            {},
            "sequence length 64 is not a multiple of 2·cp = 6 (context parallelism cuts each sequence into 2·cp "
            "chunks): choose a multiple of 6, or a smaller cp",
        ),
        (
            Parallelism(layout=Layout(dp=3)),
            {},
            "the global batch of 8 sequences does not split into dp × microbatches = 3 × 1 equal parts: choose a "
            "global batch that is a multiple of 3",
        ),
        (
            Parallelism(layout=Layout(dp=2), microbatches=3),
            {},
            "the global batch of 8 sequences does not split into dp × microbatches = 2 × 3 equal parts: choose a "
            "global batch that is a multiple of 6",
        ),
        (
            Parallelism(layout=Layout(dp=4), zero=3, hsdp_replicas=3),
            {},
            "HSDP replicas = 3 with ZeRO stage 3: ZeRO shards within each replica group, and the replicas must "
            "divide dp=4: choose among 1, 2, 4 with ZeRO stage 1, 2 or 3",
        ),
        (Parallelism(layout=Layout(), zero=5), {}, "ZeRO stage 5: choose one of 0, 1, 2, 3"),
        (
            Parallelism(layout=Layout(), recompute="some"),
            {},
            "recomputation 'some': choose one of none, selective, per-op, full",
        ),
        (
            Parallelism(layout=Layout(), schedule="pipedream"),
            {},
            "schedule 'pipedream': choose one of gpipe, 1f1b, interleaved, zero-bubble",
        ),
    ],
)
def test_impossible_layouts_are_refused_with_the_reason(par, kw, message):
    args = dict(seq=64, global_seqs=8) | kw
    with pytest.raises(FourdError) as e:
        check(DEBUG, par, **args)
    assert str(e.value) == message


def test_the_embedding_and_the_output_may_take_a_stage_each():
    check(
        DEBUG,
        Parallelism(layout=Layout(pp=3), schedule="interleaved", virtual_stages=2),
        seq=64,
        global_seqs=8,
    )
    assert layer_split(4, 6, empty_edges=True) == [0, 1, 1, 1, 1, 0]


def test_sequence_parallelism_needs_whole_token_shards():
    kv4 = with_overrides(DEBUG, kv_heads=4)
    check(kv4, Parallelism(layout=Layout(tp=4)), seq=66, global_seqs=1)
    with pytest.raises(FourdError) as e:
        check(kv4, Parallelism(layout=Layout(tp=4), sequence_parallel=True), seq=66, global_seqs=1)
    assert str(e.value) == (
        "sequence parallelism cuts each rank's 66 tokens into tp=4 parts: choose a sequence length that is a "
        "multiple of cp·tp = 4, or turn sequence parallelism off"
    )


def test_ffn_and_vocab_must_split_evenly():
    odd_ffn = ModelConfig(layers=2, dim=64, ffn=170, heads=4, kv_heads=4, vocab=256)
    with pytest.raises(
        FourdError,
        match=r"FFN width \(170\) and vocabulary \(256\) into equal parts: choose tp among 1, 2$",
    ):
        check(odd_ffn, Parallelism(layout=Layout(tp=4)), seq=8, global_seqs=1)
    odd = ModelConfig(layers=2, dim=64, ffn=176, heads=4, kv_heads=4, vocab=257)
    with pytest.raises(
        FourdError, match=r"vocabulary \(257\) into equal parts: choose tp among 1$"
    ):
        check(odd, Parallelism(layout=Layout(tp=2)), seq=8, global_seqs=1)


def test_degrees_must_be_positive_integers_not_bools_or_floats():
    for kwargs, word in [({"tp": True}, "tp=True"), ({"cp": 2.0}, "cp=2.0"), ({"dp": 0}, "dp=0")]:
        with pytest.raises(FourdError) as e:
            Layout(**kwargs)
        dim = word.split("=")[0]
        assert str(e.value) == (
            f"layout {word}: each degree must be a positive integer, e.g. {dim}=2"
        )
    assert Layout(pp=1).world == 1


def test_empty_items_and_spaces_are_skipped():
    assert parse_layout("") == Layout() == parse_layout(" , ")
    assert parse_layout(" tp = 2 ,, dp = 4 ,") == Layout(tp=2, dp=4)
    with pytest.raises(FourdError) as e:
        parse_layout("=2")
    assert str(e.value) == "layout '=2': bad item '=2'; write key=value with keys tp, cp, pp, dp"


def test_ranks_and_indices_outside_the_layout_are_refused():
    lay = Layout(tp=2, cp=1, pp=2, dp=2)
    assert lay.coords(7) == {"tp": 1, "cp": 0, "pp": 1, "dp": 1}
    assert lay.rank(tp=1, pp=1, dp=1) == 7 and lay.rank() == 0
    for rank in (8, -1):
        with pytest.raises(ValueError) as e:
            lay.coords(rank)
        assert str(e.value) == f"rank {rank} outside 0..7 of layout tp=2,cp=1,pp=2,dp=2"
    for kwargs, words in [
        ({"tp": 2}, "tp index 2 outside 0..1"),
        ({"dp": -1}, "dp index -1 outside 0..1"),
        ({"cp": 1}, "cp index 1 outside 0..0"),
        ({"pp": 2}, "pp index 2 outside 0..1"),
    ]:
        with pytest.raises(ValueError) as e:
            lay.rank(**kwargs)
        assert str(e.value) == f"{words} of layout tp=2,cp=1,pp=2,dp=2"


def test_the_rank_groups_of_a_parallelism():
    par = Parallelism(layout=Layout(tp=2, cp=2, pp=3, dp=4), virtual_stages=2, hsdp_replicas=2)
    assert (par.stages, par.grad_ranks, par.shard_ranks, par.hsdp) == (6, 8, 4, True)
    one = Parallelism(layout=Layout(cp=2, dp=3))
    assert (one.stages, one.grad_ranks, one.shard_ranks, one.hsdp) == (1, 6, 6, False)


def test_layer_splits_by_hand():
    # fewer first and last: the Llama 3 split; the leftover layers go to the edges first
    assert layer_split(5, 4) == [1, 2, 1, 1]
    assert layer_split(4, 3) == [1, 2, 1]
    assert layer_split(9, 4) == [2, 3, 2, 2]
    assert layer_split(4, 4) == [1, 1, 1, 1]
    assert layer_split(2, 4, empty_edges=True) == [0, 1, 1, 0]
    assert layer_split(1, 2, empty_edges=True) == [1, 0]
    assert layer_split(3, 4, empty_edges=True) == [1, 1, 1, 0]
    # even: the middle stages take the leftovers first
    assert layer_split(6, 4, fewer_first_last=False) == [1, 2, 2, 1]
    assert layer_split(7, 4, fewer_first_last=False) == [2, 2, 2, 1]
    assert layer_split(11, 4, fewer_first_last=False) == [3, 3, 3, 2]
    assert layer_split(3, 2, fewer_first_last=False) == [2, 1]
    assert layer_split(4, 1, fewer_first_last=False) == [4] == layer_split(4, 1)
    for layers, stages in [(2, 3), (1, 2)]:
        with pytest.raises(FourdError) as e:
            layer_split(layers, stages)
        assert str(e.value) == (
            f"{layers} layers cannot fill {stages} pipeline stages: lower pp or the virtual stages"
        )
    for layers, stages in [(0, 2), (4, 0), (-1, 1)]:
        with pytest.raises(FourdError) as e:
            layer_split(layers, stages)
        assert str(e.value) == (
            f"{layers} layers in {stages} pipeline stages: both must be at least 1"
        )


def test_stage_counts_a_model_can_take():
    assert [split_ok(4, stages) for stages in range(1, 8)] == [True] * 4 + [False, True, False]


@pytest.mark.parametrize(
    "par, seq, global_seqs, message",
    [
        (
            Parallelism(layout=Layout(), zero=True),
            64,
            8,
            "ZeRO stage True: choose one of 0, 1, 2, 3",
        ),
        (
            Parallelism(layout=Layout()),
            0,
            8,
            "sequence length 0 is not a multiple of 2·cp = 2 (context parallelism cuts each sequence into "
            "2·cp chunks): choose a multiple of 2, or a smaller cp",
        ),
        (
            Parallelism(layout=Layout()),
            64,
            0,
            "the global batch of 0 sequences does not split into dp × microbatches = 1 × 1 equal parts: "
            "choose a global batch that is a multiple of 1",
        ),
        (
            Parallelism(layout=Layout(dp=2), hsdp_replicas=0),
            64,
            8,
            "HSDP replicas = 0 with ZeRO stage 1: ZeRO shards within each replica group, and the "
            "replicas must divide dp=2: choose among 1, 2 with ZeRO stage 1, 2 or 3",
        ),
        (
            Parallelism(layout=Layout(dp=4), zero=0, hsdp_replicas=2),
            64,
            8,
            "HSDP replicas = 2 with ZeRO stage 0: ZeRO shards within each replica group, and the "
            "replicas must divide dp=4: choose among 1, 2, 4 with ZeRO stage 1, 2 or 3",
        ),
        (
            Parallelism(layout=Layout(pp=2), microbatches=0),
            64,
            8,
            "microbatches = 0 must be a positive integer",
        ),
    ],
)
def test_more_refusals_at_their_edges(par, seq, global_seqs, message):
    with pytest.raises(FourdError) as e:
        check(DEBUG, par, seq=seq, global_seqs=global_seqs)
    assert str(e.value) == message


def test_edges_that_pass():
    check(DEBUG, Parallelism(layout=Layout(dp=4), zero=3, hsdp_replicas=2), seq=2, global_seqs=4)
    check(DEBUG, Parallelism(layout=Layout(dp=4), zero=3, hsdp_replicas=4), seq=64, global_seqs=4)
    kv4 = with_overrides(DEBUG, kv_heads=4)
    check(
        kv4, Parallelism(layout=Layout(tp=4, cp=2), sequence_parallel=True), seq=16, global_seqs=1
    )
    # the same model cut by tp = 2 (heads 4, KV heads 2, FFN 176, vocabulary 256)
    check(DEBUG, Parallelism(layout=Layout(tp=2)), seq=64, global_seqs=1)


def test_sequence_parallelism_cuts_each_cp_ranks_tokens():
    # 12 tokens in cp = 2 ranks are 6 a rank: not 4 equal parts, though 12 is
    kv4 = with_overrides(DEBUG, kv_heads=4)
    with pytest.raises(FourdError) as e:
        check(
            kv4,
            Parallelism(layout=Layout(tp=4, cp=2), sequence_parallel=True),
            seq=12,
            global_seqs=1,
        )
    assert str(e.value) == (
        "sequence parallelism cuts each rank's 6 tokens into tp=4 parts: choose a sequence length that "
        "is a multiple of cp·tp = 8, or turn sequence parallelism off"
    )


def test_the_rank_formula_at_degrees_that_are_not_powers_of_two():
    lay = Layout(tp=3, cp=2, pp=5, dp=3)
    assert lay.rank(tp=1, cp=1, pp=3, dp=2) == 1 + 3 * (1 + 2 * (3 + 5 * 2)) == 82
    assert lay.coords(82) == {"tp": 1, "cp": 1, "pp": 3, "dp": 2}
    assert [lay.rank(**lay.coords(r)) for r in range(lay.world)] == list(range(90))
    assert Layout(tp=3, pp=3).rank(tp=1, pp=1) == 4


def test_layer_splits_with_many_leftover_layers_and_too_few_layers():
    # 12 in 8: 14 = 8 + 6, the six leftovers to the two edges and the first four middle stages
    assert layer_split(12, 8) == [1, 2, 2, 2, 2, 1, 1, 1]
    assert layer_split(12, 8, fewer_first_last=False) == [1, 2, 2, 2, 2, 1, 1, 1]
    # one layer cannot fill four stages, even with the edges holding only embedding and output
    with pytest.raises(FourdError) as e:
        layer_split(1, 4, empty_edges=True)
    assert str(e.value) == (
        "1 layers cannot fill 4 pipeline stages: lower pp or the virtual stages"
    )


def test_refusals_at_odd_degrees():
    with pytest.raises(ValueError) as e:
        Layout(tp=3).rank(tp=3)
    assert str(e.value) == "tp index 3 outside 0..2 of layout tp=3,cp=1,pp=1,dp=1"
    with pytest.raises(ValueError) as e:
        Layout(tp=2, pp=2, dp=2).coords(9)  # past the end, not only at it
    assert str(e.value) == "rank 9 outside 0..7 of layout tp=2,cp=1,pp=2,dp=2"
    with pytest.raises(FourdError) as e:
        check(
            DEBUG, Parallelism(layout=Layout(dp=3), zero=3, hsdp_replicas=2), seq=64, global_seqs=6
        )
    assert str(e.value) == (
        "HSDP replicas = 2 with ZeRO stage 3: ZeRO shards within each replica group, and the "
        "replicas must divide dp=3: choose among 1, 3 with ZeRO stage 1, 2 or 3"
    )
    with pytest.raises(FourdError) as e:
        check(DEBUG, Parallelism(layout=Layout(cp=2)), seq=6, global_seqs=8)
    assert str(e.value) == (
        "sequence length 6 is not a multiple of 2·cp = 4 (context parallelism cuts each sequence "
        "into 2·cp chunks): choose a multiple of 4, or a smaller cp"
    )
    assert layer_split(4, 4, fewer_first_last=False) == [1, 1, 1, 1]  # as many layers as stages


def test_more_edges_of_the_batch_the_tokens_and_the_heads():
    with pytest.raises(FourdError) as e:
        check(DEBUG, Parallelism(layout=Layout(dp=2), microbatches=2), seq=64, global_seqs=2)
    assert str(e.value) == (
        "the global batch of 2 sequences does not split into dp × microbatches = 2 × 2 equal parts: "
        "choose a global batch that is a multiple of 4"
    )
    # 68 tokens at cp = 1 are 68 a rank: 4 equal parts of 17
    kv4 = with_overrides(DEBUG, kv_heads=4)
    check(kv4, Parallelism(layout=Layout(tp=4), sequence_parallel=True), seq=68, global_seqs=1)
    # an odd KV head count: its own count is a choice
    three = ModelConfig(layers=2, dim=48, ffn=96, heads=3, kv_heads=3, vocab=255)
    with pytest.raises(FourdError) as e:
        check(three, Parallelism(layout=Layout(tp=2)), seq=8, global_seqs=1)
    assert str(e.value) == (
        "tp=2 cannot cut the model's heads (3), KV heads (3), FFN width (96) and vocabulary (255) "
        "into equal parts: choose tp among 1, 3"
    )
    # the embedding and the output a stage each, at any size
    assert split_ok(300, 302) and not split_ok(300, 301) and not split_ok(300, 303)


def test_a_parallelism_is_an_immutable_value_named_by_keywords():
    par = Parallelism(layout=Layout(pp=2), microbatches=4)
    assert par == Parallelism(layout=Layout(pp=2), microbatches=4)
    assert hash(par) == hash(Parallelism(layout=Layout(pp=2), microbatches=4))
    with pytest.raises(AttributeError):
        par.zero = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        par.layout.tp = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        Parallelism(Layout(), "1f1b")  # type: ignore[misc]


def test_indices_past_the_end_and_past_256():
    lay = Layout(tp=2, pp=2, dp=2)
    with pytest.raises(ValueError) as e:
        lay.rank(pp=3)
    assert str(e.value) == "pp index 3 outside 0..1 of layout tp=2,cp=1,pp=2,dp=2"
    # CPython keeps one object per int only up to 256: ranks and degrees past it compare by value
    big = Layout(tp=8, cp=16, pp=16, dp=8)
    with pytest.raises(ValueError) as e:
        big.coords(16384)
    assert str(e.value) == "rank 16384 outside 0..16383 of layout tp=8,cp=16,pp=16,dp=8"
    with pytest.raises(ValueError) as e:
        Layout(dp=300).rank(dp=300)
    assert str(e.value) == "dp index 300 outside 0..299 of layout tp=1,cp=1,pp=1,dp=300"


def test_the_stage_refusal_names_the_two_extra_stages_of_a_small_model():
    two = ModelConfig(layers=2, dim=64, ffn=176, heads=4, kv_heads=2, vocab=256)
    with pytest.raises(FourdError) as e:
        check(two, Parallelism(layout=Layout(pp=3)), seq=64, global_seqs=8)
    assert str(e.value) == (
        "pp=3 with 1 virtual stage makes 3 pipeline stages for 2 layers: use at most 2 stages, or "
        "exactly 4 (the embedding and the output a stage each)"
    )


def test_a_shard_group_is_a_whole_number_of_ranks():
    par = Parallelism(layout=Layout(cp=2, dp=4), zero=3, hsdp_replicas=2)
    assert par.shard_ranks == 4 and isinstance(par.shard_ranks, int)


def test_fourd_train_refuses_hsdp_below_zero_3_in_one_line_which_the_planner_plans(tmp_path):
    """The one validator takes HSDP with ZeRO 1 and 2 (the planner plans shards within groups);
    `fourd train` runs FSDP2's HSDP, ZeRO 3 only, and says so before any worker starts."""
    zero1 = Parallelism(layout=Layout(dp=4), zero=1, hsdp_replicas=2)
    check(DEBUG, zero1, seq=64, global_seqs=8)
    run_dir = tmp_path / "run"
    code, out, err = run_fourd(
        *("train", "--model", "debug", "--steps", "1", "--layout", "dp=4", "--run-dir", run_dir),
        *("--parallel.zero=1", "--parallel.hsdp_replicas=2"),
    )
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "fourd: error: parallel.hsdp_replicas = 2 with ZeRO stage 1: fourd train runs HSDP with "
        "ZeRO 3 (FSDP2's replicated shards); set parallel.zero = 3, or parallel.hsdp_replicas = 1 "
        "(the planner plans ZeRO 1 and 2 within groups too)"
    ]
    assert not run_dir.exists()
