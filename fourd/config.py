"""Training configuration: dataclasses, TOML files, and `--section.key=value` overrides.

Precedence, lowest first: the defaults, a base (a resumed run's config.toml, or an --init-from
model), the TOML file (`--config`), the short flags (`--model`, `--layout`, ...), then overrides.
Every value is checked where it is set: unknown keys, wrong types, numbers not finite or out of
range (LIMITS), names not in CHOICES."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from fourd.errors import FourdError, did_you_mean
from fourd.layout import PRECISIONS, RECOMPUTE, ZERO_STAGES, Parallelism, parse_layout
from fourd.model.config import PLANNER_ONLY_FIELDS, PRESETS, ModelConfig, get_preset, with_overrides
from fourd.schedules import SCHEDULES


def fourd_home() -> Path:
    """$FOURD_HOME (unset or empty: ~/.fourd): the token cache, measured profiles, user cluster
    profiles."""
    return Path(os.environ.get("FOURD_HOME") or "~/.fourd").expanduser()


# [model]: a preset, and any ModelConfig field but the planner's own (mlp, tied_embeddings) set on
# top of it (`--model.layers=2`); None: the preset's.
_MODEL_KEYS = typing.get_type_hints(ModelConfig)
ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    [("preset", str, "small")]
    + [
        (key, kind | None, None)
        for key, kind in _MODEL_KEYS.items()
        if key not in PLANNER_ONLY_FIELDS
    ],
)
ModelSection.__module__ = __name__  # picklable: configs travel to spawned workers


@dataclass
class DataSection:
    path: str = ""  # empty: the running interpreter's standard library (no download)
    tokenizer: str = "byte"  # "byte", or a local tokenizer.json / tiktoken BPE file
    seq_len: int = 256
    cache_dir: str = ""  # empty: $FOURD_HOME/cache (FOURD_HOME defaults to ~/.fourd)
    holdout_fraction: float = 0.01  # the corpus tail kept out of training, for evaluation
    # DIR_A=0.7,DIR_B=0.3: samples drawn from several prepared datasets by weight (docs/data.md)
    mix: str = ""


@dataclass
class TrainSection:
    steps: int = 300
    global_batch: int = 16  # sequences per optimizer step, whatever the layout
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 (autocast over FP32 weights) on CUDA
    compile: bool | None = None  # torch.compile each transformer block; unset: on CUDA, off on CPU
    fp8: bool = False  # FP8 linears through torchao (the gpu extra), on H100/H200 only
    log_every: int = 1
    # seconds of collective timeout: a hung rank fails the step instead of the job hanging
    timeout_s: float = 300.0
    # a fourd checkpoint or a Hugging Face folder whose weights the run starts from
    init_from: str = ""


@dataclass
class ParallelSection:
    layout: str = "dp=1"
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    # ZeRO stage over the dp×cp ranks: 0 replicates (DDP), 1 shards optimizer state, 2 and
    # gradients, 3 and weights
    zero: int = 2
    # more than one (with zero = 3): HSDP, ZeRO 3 inside each of this many groups
    hsdp_replicas: int = 1
    # what each layer keeps for backward: none, selective, per-op or full (fourd.layout.RECOMPUTE)
    recompute: str = "none"
    sequence_parallel: bool = False


@dataclass
class CheckpointSection:
    # steps between checkpoints; 0 = only at the end (and when a signal stops the run)
    interval: int = 0
    keep: int = 3
    async_save: bool = False


@dataclass
class EvalSection:
    every: int = 0  # steps between held-out evaluations (and at the last step); 0 = never
    batches: int = 4  # global batches of held-out windows per evaluation


@dataclass
class FaultSection:
    kill_rank: int = -1
    at_step: int = -1
    hang_rank: int = -1


@dataclass
class RunSection:
    dir: str = ""  # empty: a fresh runs/<model>-<layout>-<time>
    max_restarts: int = 0
    # with a pipeline: DIR/trace.json, the last step's actions on every rank (Chrome trace)
    trace: bool = True


@dataclass
class Config:
    model: typing.Any = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    fault: FaultSection = field(default_factory=FaultSection)
    run: RunSection = field(default_factory=RunSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        cfg = cls()
        apply(cfg, data, "config")
        return cfg

    def to_toml(self) -> str:
        """The whole configuration as TOML (unset model keys left out); `load_toml` reads it
        back."""
        out = []
        for section, values in self.to_dict().items():
            out += [
                f"[{section}]",
                *(
                    f"{key} = {json.dumps(value)}"
                    for key, value in values.items()
                    if value is not None
                ),
                "",
            ]
        return "\n".join(out)


CHOICES: dict[str, tuple] = {"model.preset": tuple(PRESETS), "parallel.schedule": SCHEDULES}
CHOICES |= {
    "parallel.zero": ZERO_STAGES,
    "parallel.recompute": RECOMPUTE,
    "train.dtype": ("auto", *PRECISIONS),
}


def _at_least(least: int):
    return (lambda value: value >= least), f"at least {least}"


_POSITIVE = (lambda value: value > 0, "positive")
_BETA = (lambda value: 0 <= value < 1, "in [0, 1)")
# Each key's own range, one entry per key (rules between keys: `check`).
LIMITS = {
    "model.layers": _at_least(1),
    "model.dim": _at_least(1),
    "model.ffn": _at_least(1),
    "model.heads": _at_least(1),
    "model.kv_heads": _at_least(1),
    "model.vocab": _at_least(1),
    "model.max_seq": _at_least(1),
    "model.head_dim": _at_least(2),
    "model.norm_eps": _POSITIVE,
    "model.rope_theta": _POSITIVE,
    "data.seq_len": _at_least(2),
    "data.holdout_fraction": (lambda value: 0 <= value < 0.5, "in [0, 0.5)"),
    "train.steps": _at_least(1),
    "train.global_batch": _at_least(1),
    "train.lr": _POSITIVE,
    "train.min_lr": _at_least(0),
    "train.warmup_steps": _at_least(0),
    "train.weight_decay": _at_least(0),
    "train.beta1": _BETA,
    "train.beta2": _BETA,
    "train.grad_clip": _POSITIVE,
    "train.seed": (lambda value: 0 <= value < 2**63, "in 0 .. 2^63 - 1"),
    "train.log_every": _at_least(1),
    "train.timeout_s": (lambda value: 0 < value <= 1e6, "in (0, 1e6] seconds"),
    "parallel.microbatches": _at_least(1),
    "parallel.virtual_stages": _at_least(1),
    "parallel.hsdp_replicas": _at_least(1),
    "checkpoint.interval": _at_least(0),
    "checkpoint.keep": _at_least(1),
    "eval.every": _at_least(0),
    "eval.batches": _at_least(1),
    "fault.kill_rank": _at_least(-1),
    "fault.at_step": _at_least(-1),
    "fault.hang_rank": _at_least(-1),
    "run.max_restarts": _at_least(0),
}


def _coerce(key: str, value, hint) -> object:
    want = next(option for option in (*typing.get_args(hint), hint) if option is not type(None))
    if value is None and type(None) in typing.get_args(hint):
        return None
    words = {
        "true": True,
        "1": True,
        "yes": True,
        "on": True,
        "false": False,
        "0": False,
        "no": False,
        "off": False,
    }
    try:
        if want is bool:
            if isinstance(value, bool):
                return value
            return words[str(value).lower()]
        if (
            want is int
            and not isinstance(value, bool)
            and not (isinstance(value, float) and not value.is_integer())
        ):
            return int(value)
        if want is float and not isinstance(value, bool) and math.isfinite(float(value)):
            return float(value)
        if want is str:
            return str(value)
    except (TypeError, ValueError, KeyError, OverflowError):
        pass
    kind = want.__name__
    if want is float:
        kind = "finite number"
    raise FourdError(f"{key} = {value!r} is not a valid {kind}")


def set_value(cfg: Config, key: str, value) -> None:
    section_name, dot, name = key.partition(".")
    sections = vars(cfg)  # the dataclass's fields: {section name: section}
    if not dot or section_name not in sections:
        raise FourdError(
            f"unknown config key {key!r}{did_you_mean(section_name, sections)}: sections are "
            f"{', '.join(sections)} (use section.key)"
        )
    hints = typing.get_type_hints(type(sections[section_name]))
    if name not in hints:
        keys = [f"{section_name}.{k}" for k in hints]
        raise FourdError(
            f"unknown config key {key!r}{did_you_mean(key, keys)}: allowed keys in "
            f"[{section_name}] are {', '.join(hints)}"
        )
    value = _coerce(key, value, hints[name])
    allowed = CHOICES.get(key)
    if allowed and value not in allowed:
        hint = did_you_mean(value, allowed)
        raise FourdError(
            f"{key} = {value!r}{hint}: allowed values are {', '.join(map(str, allowed))}"
        )
    within, what = LIMITS.get(key, (None, ""))
    if within is not None and value is not None and not within(value):
        raise FourdError(f"{key} = {value!r} must be {what}")
    setattr(sections[section_name], name, value)


def apply(cfg: Config, data: dict, where: str) -> None:
    """Set every `[section] key = value` of a parsed TOML file or dictionary."""
    for section, values in data.items():
        if not isinstance(values, dict):
            raise FourdError(f"{where}: top-level key {section!r} must be a [section] table")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value)


def load_toml(path: str | Path) -> dict:
    """The TOML file at `path` ({} for an empty path)."""
    if not str(path):
        return {}
    file = Path(path)
    if not file.is_file():
        raise FourdError(f"config file {str(file)!r} does not exist: give the path of a TOML file")
    try:
        return tomllib.loads(file.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise FourdError(f"config file {str(file)!r} is not valid TOML: {error}") from None


def parse_overrides(items: list[str], flags=()) -> list[tuple[str, str]]:
    """`--section.key=value` or `--section.key value` words → (key, value) pairs; `flags` for
    suggestions."""
    out, words = [], iter(items)
    for word in words:
        if not word.startswith("--") or "." not in word.split("=")[0]:
            hint = did_you_mean(word.split("=")[0], flags)
            raise FourdError(
                f"unrecognised argument {word!r}{hint}: overrides look like --section.key=value"
            )
        key, equals, value = word[2:].partition("=")
        key = key.replace("-", "_")  # --fault.kill-rank is --fault.kill_rank
        given: str | None = value
        if not equals:  # --section.key VALUE
            given = next(words, None)
        if given is None:
            raise FourdError(f"--{key} needs a value: --{key}=VALUE")
        out.append((key, given))
    return out


def build_config(
    toml: str | None, flags: dict, overrides: list[str], base: dict | None = None, options=()
) -> Config:
    """The configuration from its layers (module docstring); `options`: the command's flags, for
    suggestions."""
    cfg = Config()
    apply(cfg, base or {}, "base configuration")
    apply(cfg, load_toml(toml or ""), f"config file {toml!r}")
    for key, value in flags.items():
        if value is not None:
            set_value(cfg, key, value)
    for key, value in parse_overrides(overrides, options):
        set_value(cfg, key, value)
    check(cfg)
    return cfg


def check(cfg: Config) -> None:
    """Rules between keys; each key's own range is in LIMITS."""
    train, fault = cfg.train, cfg.fault
    if train.min_lr > train.lr:
        raise FourdError(f"train.min_lr = {train.min_lr} is above train.lr = {train.lr}: lower it")
    # an "auto" layout is checked again once the planner has chosen it
    world = 1 << 62
    if cfg.parallel.layout != "auto":
        world = parse_layout(cfg.parallel.layout).world
    for key in ("kill_rank", "hang_rank"):
        rank = getattr(fault, key)
        if rank >= world:
            raise FourdError(
                f"fault.{key} = {rank} is not a rank of the {world}-rank layout: "
                f"choose 0 .. {world - 1}"
            )
        if rank >= 0 and not 1 <= fault.at_step <= train.steps:
            raise FourdError(
                f"fault.{key} needs fault.at_step, a step in 1 .. {train.steps} (it is "
                f"{fault.at_step})"
            )
    if fault.at_step >= 0 and fault.kill_rank < 0 and fault.hang_rank < 0:
        raise FourdError(
            "fault.at_step is set but neither fault.kill_rank nor "
            "fault.hang_rank: set one, or drop it"
        )


def model_config(cfg: Config) -> ModelConfig:
    over = {
        key: value
        for key, value in dataclasses.asdict(cfg.model).items()
        if key != "preset" and value is not None
    }
    model = with_overrides(get_preset(cfg.model.preset), **over)
    if cfg.data.seq_len > model.max_seq:
        raise FourdError(
            f"data.seq_len = {cfg.data.seq_len} is longer than the model's max_seq = "
            f"{model.max_seq}: raise --model.max_seq or shorten data.seq_len"
        )
    return model


def parallelism(cfg: Config) -> Parallelism:
    """The run's Parallelism, in the words the planner uses too."""
    settings = cfg.parallel
    return Parallelism(
        layout=parse_layout(settings.layout),
        schedule=settings.schedule,
        microbatches=settings.microbatches,
        virtual_stages=settings.virtual_stages,
        zero=settings.zero,
        recompute=settings.recompute,
        sequence_parallel=settings.sequence_parallel,
        hsdp_replicas=settings.hsdp_replicas,
    )
