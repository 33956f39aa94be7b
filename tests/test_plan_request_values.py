"""The planner request's values at their edges (fourd.plan.request): every bounded setting's last value
accepted and first refused, the count suffixes, the refusals' words, and the defaults a request takes
when a setting is left open."""

import argparse

import pytest

from fourd.errors import FourdError
from fourd.layout import Layout
from fourd.model.config import get_preset
from fourd.plan import request
from fourd.plan.cluster import load_cluster

H100 = load_cluster("llama3-h100")
L8B = get_preset("llama3-8b")

# Each bounded setting's range as `fourd plan --help` users meet it, written out by hand: a loosened
# or tightened bound changes one of these.
RANGES = {
    "gpus": (1, 2**20),
    "microbatches": (1, 2**30),
    "virtual_stages": (1, 2**16),
    "seq": (2, 2**24),
    "hsdp_replicas": (1, 2**20),
    "global_seqs": (1, 2**40),
}


@pytest.mark.parametrize("key", sorted(RANGES))
def test_each_bounded_setting_takes_its_ends_and_refuses_beyond(key):
    parse = request.SETTINGS[key][0]
    low, high = RANGES[key]
    assert parse(str(low)) == low
    assert parse(str(high)) == high
    what = "a sequence length" if key == "seq" else "a whole number"
    for outside in (low - 1, high + 1):
        with pytest.raises(request.BadValue) as refused:
            parse(str(outside))
        assert (
            str(refused.value) == f"{outside} is out of range: give {what} from {low} to {high:,}"
        )


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1K", 2**10),
        ("16M", 2**24),
        ("16m", 2**24),
        ("2G", 2**31),
        ("1.5B", 1.5e9),
        ("15.6T", 15.6e12),
        ("0.5", 0.5),
        (" 4096 ", 4096),
    ],
)
def test_counts_take_binary_and_decimal_suffixes(text, value):
    assert request.count(text) == value


def test_a_count_must_be_positive_and_finite():
    for bad in ("0", "-1K", "inf"):
        with pytest.raises(request.BadValue) as refused:
            request.count(bad)
        assert str(refused.value) == f"{bad!r} must be a positive finite count, e.g. 16M or 15.6T"


def test_refusals_quote_at_most_40_characters_of_what_was_given():
    text = "x" * 39 + "yz"  # 41 characters: the message quotes the first 40
    quoted = repr(text[:40])
    with pytest.raises(request.BadValue) as refused:
        request.bounded(int, 1)(text)
    assert str(refused.value) == f"{quoted} is not a whole number"
    with pytest.raises(request.BadValue) as refused:
        request.count(text)
    assert str(refused.value) == f"{quoted} is not a count: write e.g. 16777216, 16M or 15.6T"
    with pytest.raises(request.BadValue) as refused:
        request.on_off(text)
    assert str(refused.value) == f"{quoted}: choose on or off"
    negative = "-" + "1" * 44  # a number, not positive: quoted to 40 characters too
    with pytest.raises(request.BadValue) as refused:
        request.count(negative)
    assert (
        str(refused.value)
        == f"{negative[:40]!r} must be a positive finite count, e.g. 16M or 15.6T"
    )


def test_a_number_out_of_a_float_range_and_a_choice_not_a_number():
    with pytest.raises(request.BadValue) as refused:
        request.bounded(float, 0, 1)("2")
    assert str(refused.value) == "2.0 is out of range: give a number from 0 to 1"
    with pytest.raises(request.BadValue) as refused:
        request.bounded(float, 0)("abc")
    assert str(refused.value) == "'abc' is not a number"
    with pytest.raises(request.BadValue) as refused:
        request.SETTINGS["zero"][0]("abc")
    assert str(refused.value) == "'abc': choose one of 0, 1, 2, 3"


def test_a_batch_rounded_up_to_the_replicas_share_is_said(capsys):
    """126 sequences over 4 replicas: 31.5 each, planned as 32 (128 sequences), and said."""
    resolved = request.resolve(
        L8B, H100, {"layout": "tp=8,dp=4", "seq": 4096, "global_batch_tokens": 126 * 4096}
    )
    assert resolved.base.global_seqs == 128
    note = "fourd: note: 126 sequences do not split into 4 equal parts: planned with 128\n"
    assert capsys.readouterr().err == note


def test_a_layout_smaller_than_the_gpus_asked_is_refused():
    with pytest.raises(FourdError) as refused:
        request.resolve(L8B, H100, {"layout": "tp=8", "gpus": 16})
    assert str(refused.value) == (
        "layout tp=8,cp=1,pp=1,dp=1 uses 8 GPUs but 16 are asked: make the product of the degrees "
        "equal 16"
    )


def test_virtual_stages_pin_the_interleaved_schedule_only_beyond_one():
    values = {"layout": "tp=8,pp=4", "seq": 4096, "global_batch_tokens": "1M"}
    one = request.resolve(L8B, H100, values | {"virtual_stages": 1})
    assert one.fixed["schedule"] is None and "schedule" in one.open
    two = request.resolve(L8B, H100, values | {"virtual_stages": 2})
    assert two.fixed["schedule"] == "interleaved" and "schedule" not in two.open


def test_tp_overlap_without_sequence_parallelism_is_fine_without_tp():
    values = {"seq": 4096, "global_batch_tokens": "1M", "tp_overlap": "on"}
    values |= {"sequence_parallel": "off"}
    request.resolve(L8B, H100, values | {"layout": "dp=8"})  # no TP: nothing to overlap, no refusal
    with pytest.raises(FourdError, match="^TP overlap runs with sequence parallelism only"):
        request.resolve(L8B, H100, values | {"layout": "tp=2,dp=4"})


@pytest.mark.parametrize(("replicas", "zero"), [(1, 0), (2, 3)])
def test_hsdp_replicas_default_the_checked_zero_stage(replicas, zero):
    """The user's layout is checked before the search with ZeRO 3 where HSDP shards, else 0."""
    fixed = dict.fromkeys(request.OPEN) | {"schedule": None, "sequence_parallel": True}
    fixed["hsdp_replicas"] = replicas
    pinned = request._pinned_parallelism(Layout(dp=4), fixed)
    assert pinned.zero == zero
    assert (pinned.schedule, pinned.microbatches, pinned.virtual_stages) == ("1f1b", 1, 1)
    assert pinned.recompute == "none"


def test_a_choice_quotes_at_most_40_characters_of_what_was_given():
    text = "x" * 39 + "yz"
    with pytest.raises(request.BadValue) as refused:
        request.SETTINGS["zero"][0](text)
    assert str(refused.value) == f"{text[:40]!r}: choose one of 0, 1, 2, 3"


def test_a_batch_rounds_to_the_replicas_times_the_pinned_microbatches(capsys):
    """130 sequences over 4 replicas of 3 microbatches: 10.83 × 12, planned as 11 × 12 = 132."""
    values = {"layout": "tp=8,dp=4", "seq": 4096, "global_batch_tokens": 130 * 4096}
    resolved = request.resolve(L8B, H100, values | {"microbatches": 3})
    assert resolved.base.global_seqs == 132
    note = "fourd: note: 130 sequences do not split into 12 equal parts: planned with 132\n"
    assert capsys.readouterr().err == note


@pytest.mark.parametrize(
    ("settings", "chosen"),
    [
        ({}, ("schedule", "virtual stages", "microbatches", "zero", "recompute", "compile")),
        ({"schedule": "1f1b"}, ("microbatches", "zero", "recompute", "compile")),
        (
            {"schedule": "interleaved"},
            ("virtual stages", "microbatches", "zero", "recompute", "compile"),
        ),
        (
            {"stack": "megatron-core"},
            ("schedule", "virtual stages", "microbatches", "zero", "recompute"),
        ),
        ({"compiled": "on"}, ("schedule", "virtual stages", "microbatches", "zero", "recompute")),
    ],
)
def test_what_the_planner_chooses_is_what_the_request_left_open(settings, chosen):
    """Virtual stages are open only where the schedule may interleave; compilation only where the
    stack would compile (fourd's eager blocks on a GPU, not Megatron-Core's fused kernels) and it
    was not pinned."""
    values = {"layout": "tp=8,pp=4", "seq": 4096, "global_batch_tokens": "1M"}
    assert request.resolve(L8B, H100, values | settings).open == chosen


def test_no_virtual_stages_asked_leaves_the_schedule_open():
    values = {"layout": "tp=8,pp=4", "seq": 4096, "global_batch_tokens": "1M"}
    resolved = request.resolve(L8B, H100, values)
    assert resolved.fixed["schedule"] is None and "schedule" in resolved.open


def test_the_flags_are_the_settings_with_help_and_top_defaults_to_ten():
    parser = argparse.ArgumentParser()
    request.add_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    assert "--global-seqs" not in flags  # set by callers, not a flag: it has no help text
    assert {"--global-batch-tokens", "--virtual-stages", "--top"} <= flags
    assert parser.parse_args([]).top == 10


def test_without_a_layout_a_pinned_schedule_is_meant_for_a_pipeline_and_zero_for_none(capsys):
    """DeepSpeed runs 1F1B only, and ZeRO 2 and 3 only without a pipeline: with no layout, a pinned
    interleaved schedule is noted (as on pp > 1) and a pinned ZeRO 3 is not (as on pp = 1)."""
    values = {"gpus": 16, "seq": 4096, "global_batch_tokens": "1M", "stack": "deepspeed"}
    request.resolve(L8B, H100, values | {"schedule": "interleaved"})
    assert capsys.readouterr().err == (
        "fourd: note: the deepspeed stack runs the schedules 1f1b, not interleaved: planned as "
        "asked\n"
    )
    request.resolve(L8B, H100, values | {"zero": 3})
    assert capsys.readouterr().err == ""


def test_a_range_without_a_top_names_its_bottom_only():
    with pytest.raises(request.BadValue) as refused:
        request.bounded(int, 1)("0")
    assert str(refused.value) == "0 is out of range: give a whole number from 1"
    with pytest.raises(request.BadValue) as refused:
        request.bounded(float, 0.5)("inf")
    assert str(refused.value) == "inf is out of range: give a number from 0.5"
