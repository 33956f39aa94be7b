"""`fourd train`'s configuration in one process (fast): how each value is read (words, numbers, unset
keys), the one-line refusal of each bad key, value, file and override, the precedence of the layers, the
rules between keys at their edges, and what the resolved configuration hands to the model and the layout.

The end-to-end refusals (`fourd train` exiting 2 with the line) are tests/test_train_loop.py's, marked slow.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import tomllib

from fourd.config import (
    Config,
    apply,
    build_config,
    check,
    fourd_home,
    load_toml,
    model_config,
    parallelism,
    parse_overrides,
    set_value,
)
from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism

SECTIONS = "model, data, train, parallel, checkpoint, eval, fault, run"


# The configuration of `fourd train` without flags, written out here by hand (as the limits are in
# test_contract_limits.py): a default changed by mistake changes one of these. Those the docs state:
# seq_len 256, global_batch 16, no SP (docs/planner.md), ZeRO 2 (docs/parallelism.md), checkpoint.keep 3
# and timeout_s 300 (docs/fault-tolerance.md), eval.batches 4 (README); compile unset: on CUDA only.
DEFAULTS = {
    "model": {"preset": "small"},
    "data": {
        "path": "",
        "tokenizer": "byte",
        "seq_len": 256,
        "cache_dir": "",
        "holdout_fraction": 0.01,
        "mix": "",
    },
    "train": {
        "steps": 300,
        "global_batch": 16,
        "lr": 0.003,
        "min_lr": 0.0003,
        "warmup_steps": 20,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "grad_clip": 1.0,
        "seed": 0,
        "dtype": "auto",
        "compile": None,
        "fp8": False,
        "log_every": 1,
        "timeout_s": 300.0,
        "init_from": "",
    },
    "parallel": {
        "layout": "dp=1",
        "schedule": "1f1b",
        "microbatches": 1,
        "virtual_stages": 1,
        "zero": 2,
        "hsdp_replicas": 1,
        "recompute": "none",
        "sequence_parallel": False,
    },
    "checkpoint": {"interval": 0, "keep": 3, "async_save": False},
    "eval": {"every": 0, "batches": 4},
    "fault": {"kill_rank": -1, "at_step": -1, "hang_rank": -1},
    "run": {"dir": "", "max_restarts": 0, "trace": True},
}


def test_every_default_is_the_one_written_out():
    given = Config().to_dict()
    model = given.pop("model")
    assert {key: value for key, value in model.items() if value is not None} == DEFAULTS["model"]
    assert given == {section: DEFAULTS[section] for section in given}
    assert list(given) == list(DEFAULTS)[1:]
    # and the defaults make a run: the checks pass, the small model (max_seq 1024) takes 256 tokens
    cfg = build_config(None, {}, [])
    assert (model_config(cfg).max_seq, parallelism(cfg)) == (
        1024,
        Parallelism(layout=Layout(), zero=2),
    )


def _set(key, value):
    cfg = Config()
    set_value(cfg, key, value)
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _refused(call, *args, **kwargs) -> str:
    with pytest.raises(FourdError) as refused:
        call(*args, **kwargs)
    return str(refused.value)


def test_fourd_home_is_the_variable_or_dot_fourd_in_home(monkeypatch, tmp_path):
    monkeypatch.setenv("FOURD_HOME", str(tmp_path / "h"))
    assert fourd_home() == tmp_path / "h"
    monkeypatch.setenv("FOURD_HOME", "")
    assert fourd_home() == Path.home() / ".fourd"
    monkeypatch.delenv("FOURD_HOME")
    assert fourd_home() == Path.home() / ".fourd"


@pytest.mark.parametrize(
    "word, value",
    [("true", True), ("1", True), ("YES", True), ("on", True), (True, True)]
    + [("false", False), ("0", False), ("No", False), ("off", False), (False, False)],
)
def test_a_switch_reads_its_words(word, value):
    assert _set("parallel.sequence_parallel", word) is value
    assert _set("train.compile", word) is value  # bool | None: a word is still read


def test_numbers_and_words_are_read_as_their_keys_type():
    assert _set("train.steps", "7") == 7 and type(_set("train.steps", "7")) is int
    assert _set("train.steps", 7.0) == 7 and type(_set("train.steps", 7.0)) is int
    assert _set("train.lr", "0.01") == 0.01
    assert _set("train.lr", 1) == 1.0 and type(_set("train.lr", 1)) is float
    assert _set("data.path", 5) == "5"
    assert _set("model.layers", "3") == 3  # int | None
    assert _set("model.norm_eps", "1e-5") == 1e-5  # float | None
    assert _set("model.layers", None) is None  # unset: the preset's
    assert _set("train.compile", None) is None  # unset: on CUDA, off on CPU
    assert _set("run.trace", "off") is False


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.steps", 7.5, "train.steps = 7.5 is not a valid int"),
        ("train.steps", True, "train.steps = True is not a valid int"),
        ("train.steps", float("inf"), "train.steps = inf is not a valid int"),
        ("train.steps", "x", "train.steps = 'x' is not a valid int"),
        ("train.steps", None, "train.steps = None is not a valid int"),
        ("train.lr", None, "train.lr = None is not a valid finite number"),
        ("train.lr", True, "train.lr = True is not a valid finite number"),
        ("train.lr", "inf", "train.lr = 'inf' is not a valid finite number"),
        ("train.lr", float("nan"), "train.lr = nan is not a valid finite number"),
        ("train.fp8", "maybe", "train.fp8 = 'maybe' is not a valid bool"),
        ("train.fp8", None, "train.fp8 = None is not a valid bool"),
        ("model.layers", 2.5, "model.layers = 2.5 is not a valid int"),
        ("model.norm_eps", "tiny", "model.norm_eps = 'tiny' is not a valid finite number"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_in_one_line(key, value, message):
    assert _refused(set_value, Config(), key, value) == message


@pytest.mark.parametrize(
    "key, value, what",
    [
        ("train.beta1", 1.5, "in [0, 1)"),
        ("train.beta2", 2.0, "in [0, 1)"),
        ("data.holdout_fraction", 0.6, "in [0, 0.5)"),
        ("train.seed", 2**63 + 1, "in 0 .. 2^63 - 1"),
        ("train.timeout_s", -1.0, "in (0, 1e6] seconds"),
        ("train.timeout_s", 1e7, "in (0, 1e6] seconds"),
    ],
)
def test_values_far_beyond_a_bound_are_refused_too(key, value, what):
    # test_contract_limits.py takes each bound's nearest values; these lie further out
    assert _refused(set_value, Config(), key, value) == f"{key} = {value!r} must be {what}"


def test_unknown_keys_are_refused_with_the_keys_there_are():
    assert _refused(set_value, Config(), "lr", 1) == (
        f"unknown config key 'lr': sections are {SECTIONS} (use section.key)"
    )
    assert _refused(set_value, Config(), "trian.lr", 1) == (
        f"unknown config key 'trian.lr' (did you mean `train`?): sections are {SECTIONS} (use "
        "section.key)"
    )
    assert _refused(set_value, Config(), "train.lrr", 1) == (
        "unknown config key 'train.lrr' (did you mean `train.lr`?): allowed keys in [train] are "
        "steps, global_batch, lr, min_lr, warmup_steps, weight_decay, beta1, beta2, grad_clip, "
        "seed, dtype, compile, fp8, log_every, timeout_s, init_from"
    )
    # the model section is a preset and the ModelConfig fields but mlp
    assert _refused(set_value, Config(), "model.mlp", "gelu") == (
        "unknown config key 'model.mlp' (did you mean `model.dim`?): allowed keys in [model] are "
        "preset, layers, dim, ffn, heads, kv_heads, vocab, head_dim, norm_eps, rope_theta, max_seq"
    )


def test_named_choices_are_refused_with_the_allowed_values():
    assert _refused(set_value, Config(), "train.dtype", "bf61") == (
        "train.dtype = 'bf61' (did you mean `bf16`?): allowed values are auto, bf16, fp32"
    )
    assert _refused(set_value, Config(), "parallel.zero", 4) == (
        "parallel.zero = 4: allowed values are 0, 1, 2, 3"
    )
    assert _refused(set_value, Config(), "parallel.recompute", "some") == (
        "parallel.recompute = 'some': allowed values are none, selective, per-op, full"
    )
    assert [_set("train.dtype", word) for word in ("auto", "bf16", "fp32")] == [
        "auto",
        "bf16",
        "fp32",
    ]
    assert [_set("parallel.zero", stage) for stage in ("0", 3)] == [0, 3]


def test_a_table_is_needed_for_each_section():
    assert _refused(Config.from_dict, {"steps": 3}) == (
        "config: top-level key 'steps' must be a [section] table"
    )
    cfg = Config()
    apply(cfg, {"train": {"steps": 3}, "model": {"layers": 2}}, "here")
    assert (cfg.train.steps, cfg.model.layers) == (3, 2)


def test_the_written_configuration_reads_back_and_leaves_unset_model_keys_out():
    cfg = Config()
    for key, value in {"model.layers": 2, "train.lr": 0.01, "run.trace": False}.items():
        set_value(cfg, key, value)
    text = cfg.to_toml()
    assert text.startswith('[model]\npreset = "small"\nlayers = 2\n\n[data]\n')
    assert "compile" not in text  # unset
    back = Config.from_dict(tomllib.loads(text))
    assert back.to_dict() == cfg.to_dict()
    assert back.model.dim is None and back.train.compile is None
    # spawned workers receive it pickled
    assert pickle.loads(pickle.dumps(cfg)).to_dict() == cfg.to_dict()


def test_config_files(tmp_path):
    assert load_toml("") == {}
    missing = tmp_path / "none.toml"
    assert _refused(load_toml, missing) == (
        f"config file '{missing}' does not exist: give the path of a TOML file"
    )
    assert _refused(load_toml, tmp_path) == (
        f"config file '{tmp_path}' does not exist: give the path of a TOML file"
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    assert _refused(load_toml, bad).startswith(f"config file '{bad}' is not valid TOML: ")
    bad.write_bytes(b"[train]\nsteps = '\xff'\n")
    assert _refused(load_toml, bad).startswith(f"config file '{bad}' is not valid TOML: ")
    good = tmp_path / "c.toml"
    good.write_text("[train]\nsteps = 7\n")
    assert load_toml(good) == {"train": {"steps": 7}} == load_toml(str(good))


def test_overrides_are_read_in_both_spellings():
    words = ["--train.lr=1e-3", "--train.steps", "5", "--fault.kill-rank=0", "--data.path="]
    assert parse_overrides(words) == [
        ("train.lr", "1e-3"),
        ("train.steps", "5"),
        ("fault.kill_rank", "0"),
        ("data.path", ""),
    ]
    assert parse_overrides(["--run.dir", "--x"]) == [("run.dir", "--x")]
    assert parse_overrides([]) == []


def test_malformed_overrides_are_refused_with_the_form():
    form = "overrides look like --section.key=value"
    assert (
        _refused(parse_overrides, ["train.lr=1"]) == f"unrecognised argument 'train.lr=1': {form}"
    )
    # the dot must be in the key, not in the value
    assert _refused(parse_overrides, ["--lr=0.1"]) == f"unrecognised argument '--lr=0.1': {form}"
    assert _refused(parse_overrides, ["--modle"], ["--model", "--steps"]) == (
        f"unrecognised argument '--modle' (did you mean `--model`?): {form}"
    )
    assert _refused(parse_overrides, ["--modle=debug"], ["--model"]) == (
        f"unrecognised argument '--modle=debug' (did you mean `--model`?): {form}"
    )
    assert _refused(parse_overrides, ["--train.steps"]) == (
        "--train.steps needs a value: --train.steps=VALUE"
    )
    assert _refused(parse_overrides, ["--train.lr=1", "--train.steps"]) == (
        "--train.steps needs a value: --train.steps=VALUE"
    )


def test_layers_apply_lowest_first(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\nsteps = 7\nlr = 0.01\nseed = 3\n")
    base = {"train": {"steps": 5, "lr": 0.02, "seed": 2, "warmup_steps": 4}}
    cfg = build_config(
        str(toml), {"train.steps": 9, "train.seed": None}, ["--train.lr=0.002"], base=base
    )
    # base < file < flags (an unset flag changes nothing) < overrides
    assert (cfg.train.warmup_steps, cfg.train.seed, cfg.train.steps, cfg.train.lr) == (
        4,
        3,
        9,
        0.002,
    )
    assert build_config(None, {}, []).to_dict() == Config().to_dict()
    # the rules between keys are checked on the result
    assert _refused(build_config, None, {}, ["--train.min_lr=0.01"]) == (
        "train.min_lr = 0.01 is above train.lr = 0.003: lower it"
    )


def _checked(**values):
    cfg = Config()
    for key, value in values.items():
        set_value(cfg, key.replace("__", "."), value)
    check(cfg)
    return cfg


def test_min_lr_may_equal_lr_and_not_exceed_it():
    _checked(train__lr=0.01, train__min_lr=0.01)
    assert _refused(_checked, train__lr=0.01, train__min_lr=0.0101) == (
        "train.min_lr = 0.0101 is above train.lr = 0.01: lower it"
    )


@pytest.mark.parametrize("key", ["kill_rank", "hang_rank"])
def test_a_fault_names_a_rank_of_the_layout_and_a_step_of_the_run(key):
    fault = f"fault__{key}"
    _checked(parallel__layout="dp=2", **{fault: 1}, fault__at_step=1)
    _checked(parallel__layout="dp=2", **{fault: 0}, train__steps=5, fault__at_step=5)
    for rank in (2, 3):
        assert _refused(_checked, parallel__layout="dp=2", **{fault: rank}, fault__at_step=1) == (
            f"fault.{key} = {rank} is not a rank of the 2-rank layout: choose 0 .. 1"
        )
    for rank, step in [(0, -1), (0, 0), (0, 6), (1, -1), (1, 6)]:
        assert _refused(
            _checked, parallel__layout="dp=2", **{fault: rank}, train__steps=5, fault__at_step=step
        ) == (f"fault.{key} needs fault.at_step, a step in 1 .. 5 (it is {step})")
    # an auto layout is checked once the planner has chosen it: any rank passes here
    _checked(parallel__layout="auto", **{fault: 1000}, fault__at_step=1)


def test_the_layout_is_read_for_the_rules_unless_it_is_auto():
    # as a flag gives it: a string made at run time, not the literal "auto"
    cfg = build_config(
        None, {}, ["--parallel.layout=auto", "--fault.kill_rank=1000", "--fault.at_step=1"]
    )
    assert (cfg.parallel.layout, cfg.fault.kill_rank) == ("auto", 1000)
    # any other text is a layout, even one that sorts before "auto"
    assert _refused(_checked, parallel__layout="  dp=2", fault__kill_rank=2, fault__at_step=1) == (
        "fault.kill_rank = 2 is not a rank of the 2-rank layout: choose 0 .. 1"
    )
    assert _refused(_checked, parallel__layout="DP=2") == (
        "layout 'DP=2': bad item 'DP=2'; write key=value with keys tp, cp, pp, dp"
    )


def test_an_auto_layout_bounds_fault_ranks_at_two_to_the_62():
    _checked(parallel__layout="auto", fault__kill_rank=2**62 - 1, fault__at_step=1)
    assert _refused(
        _checked, parallel__layout="auto", fault__kill_rank=2**62, fault__at_step=1
    ) == (
        f"fault.kill_rank = {2**62} is not a rank of the {2**62}-rank layout: choose 0 .. {2**62 - 1}"
    )


def test_a_fault_step_needs_a_fault():
    for step in (0, 1):
        assert _refused(_checked, fault__at_step=step) == (
            "fault.at_step is set but neither fault.kill_rank nor fault.hang_rank: set one, or drop it"
        )
    _checked(fault__at_step=-1)
    _checked(fault__hang_rank=0, fault__at_step=1)
    _checked(fault__kill_rank=0, fault__at_step=1)


def test_the_model_is_the_preset_with_the_set_keys_on_top():
    cfg = _checked(model__preset="debug", model__layers=2, data__seq_len=64)
    model = model_config(cfg)
    assert (model.layers, model.dim, model.max_seq) == (2, 64, 256)
    cfg = _checked(model__preset="debug", data__seq_len=256)
    assert model_config(cfg).layers == 4  # the debug preset's, layers left unset
    # every key set is on top, whatever its name
    cfg = _checked(model__preset="debug", model__vocab=512, model__rope_theta=1e4, model__ffn=128)
    assert (model_config(cfg).vocab, model_config(cfg).rope_theta, model_config(cfg).ffn) == (
        512,
        1e4,
        128,
    )
    cfg = _checked(model__preset="debug", data__seq_len=257)
    assert _refused(model_config, cfg) == (
        "data.seq_len = 257 is longer than the model's max_seq = 256: raise --model.max_seq or "
        "shorten data.seq_len"
    )


def test_the_parallel_section_is_the_runs_parallelism():
    cfg = _checked(
        parallel__layout="tp=2,pp=2,dp=2",
        parallel__schedule="interleaved",
        parallel__microbatches=4,
        parallel__virtual_stages=2,
        parallel__zero=3,
        parallel__recompute="full",
        parallel__sequence_parallel=True,
        parallel__hsdp_replicas=2,
    )
    assert parallelism(cfg) == Parallelism(
        layout=Layout(tp=2, pp=2, dp=2),
        schedule="interleaved",
        microbatches=4,
        virtual_stages=2,
        zero=3,
        recompute="full",
        sequence_parallel=True,
        hsdp_replicas=2,
    )
