"""Training configuration: dataclasses, TOML files, and `--section.key=value` overrides.

Precedence, lowest first: the defaults, a base (a resumed run's config.toml, or an --init-from model), the TOML
file (`--config`), the short flags (`--model`, `--layout`, ...), then overrides. Every value is checked where it
is set: unknown keys, wrong types, numbers not finite or out of range (LIMITS), names not in CHOICES."""

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
from fourd.model.config import PRESETS, ModelConfig, get_preset, with_overrides
from fourd.schedules import SCHEDULES


def fourd_home() -> Path:
    """$FOURD_HOME (unset or empty: ~/.fourd): the token cache, measured profiles, user cluster profiles."""
    return Path(os.environ.get("FOURD_HOME") or "~/.fourd").expanduser()


# [model]: a preset, and any ModelConfig field but mlp set on top of it (`--model.layers=2`); None: the preset's.
_MODEL_KEYS = typing.get_type_hints(ModelConfig)
ModelSection = dataclasses.make_dataclass(
    "ModelSection",
    [("preset", str, "small")]
    + [(k, t | None, None) for k, t in _MODEL_KEYS.items() if k != "mlp"],
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
    timeout_s: float = (
        300.0  # collective timeout: a hung rank fails the step instead of the job hanging
    )
    init_from: str = (
        ""  # a fourd checkpoint or a Hugging Face folder whose weights the run starts from
    )


@dataclass
class ParallelSection:
    layout: str = "dp=1"
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    zero: int = (
        2  # ZeRO stage over the dp×cp ranks: 0 replicates (DDP), 1 shards optimizer state, 2 and
    )
    # gradients, 3 and weights
    hsdp_replicas: int = (
        1  # more than one (with zero = 3): HSDP, ZeRO 3 inside each of this many groups
    )
    recompute: str = "none"  # none, selective or full: what each layer keeps for backward
    sequence_parallel: bool = False


@dataclass
class CheckpointSection:
    interval: int = (
        0  # steps between checkpoints; 0 = only at the end (and when a signal stops the run)
    )
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
    trace: bool = True  # with a pipeline: DIR/trace.json, the last step's actions on every rank (Chrome trace)


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
    def from_dict(cls, d: dict) -> Config:
        cfg = cls()
        apply(cfg, d, "config")
        return cfg

    def to_toml(self) -> str:
        """The whole configuration as TOML (unset model keys left out); `load_toml` reads it back."""
        out = []
        for section, values in self.to_dict().items():
            out += [
                f"[{section}]",
                *(f"{k} = {json.dumps(v)}" for k, v in values.items() if v is not None),
                "",
            ]
        return "\n".join(out)


CHOICES: dict[str, tuple] = {"model.preset": tuple(PRESETS), "parallel.schedule": SCHEDULES}
CHOICES |= {
    "parallel.zero": ZERO_STAGES,
    "parallel.recompute": RECOMPUTE,
    "train.dtype": ("auto", *PRECISIONS),
}


def _at_least(lo: int):
    return (lambda v: v >= lo), f"at least {lo}"


_POSITIVE, _BETA = (lambda v: v > 0, "positive"), (lambda v: 0 <= v < 1, "in [0, 1)")
LIMITS = {
    f"model.{k}": _at_least(1)
    for k in ("layers", "dim", "ffn", "heads", "kv_heads", "vocab", "max_seq")
}
LIMITS |= {
    k: _at_least(1)
    for k in ("train.steps", "train.global_batch", "train.log_every", "checkpoint.keep")
}
LIMITS |= {
    f"parallel.{k}": _at_least(1) for k in ("microbatches", "virtual_stages", "hsdp_replicas")
}
LIMITS |= {
    k: _at_least(0)
    for k in ("train.min_lr", "train.warmup_steps", "train.weight_decay", "run.max_restarts")
}
LIMITS |= {f"fault.{k}": _at_least(-1) for k in ("kill_rank", "at_step", "hang_rank")}
LIMITS |= dict.fromkeys(
    ("model.norm_eps", "model.rope_theta", "train.lr", "train.grad_clip"), _POSITIVE
)
LIMITS |= {
    "checkpoint.interval": _at_least(0),
    "eval.every": _at_least(0),
    "eval.batches": _at_least(1),
}
LIMITS |= {
    "model.head_dim": _at_least(2),
    "data.seq_len": _at_least(2),
    "train.beta1": _BETA,
    "train.beta2": _BETA,
}
LIMITS |= {
    "data.holdout_fraction": (lambda v: 0 <= v < 0.5, "in [0, 0.5)"),
    "train.seed": (lambda v: 0 <= v < 2**63, "in 0 .. 2^63 - 1"),
    "train.timeout_s": (lambda v: 0 < v <= 1e6, "in (0, 1e6] seconds"),
}


def _coerce(key: str, value, hint) -> object:
    want = next(t for t in (*typing.get_args(hint), hint) if t is not type(None))
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
            return value if isinstance(value, bool) else words[str(value).lower()]
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
    kind = "finite number" if want is float else want.__name__
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
            f"unknown config key {key!r}{did_you_mean(key, keys)}: allowed keys in [{section_name}] are {', '.join(hints)}"
        )
    value = _coerce(key, value, hints[name])
    allowed = CHOICES.get(key)
    if allowed and value not in allowed:
        hint = did_you_mean(value, allowed)
        raise FourdError(
            f"{key} = {value!r}{hint}: allowed values are {', '.join(map(str, allowed))}"
        )
    ok, what = LIMITS.get(key, (None, ""))
    if ok is not None and value is not None and not ok(value):
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
    p = Path(path)
    if not p.is_file():
        raise FourdError(f"config file {str(p)!r} does not exist: give the path of a TOML file")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FourdError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def parse_overrides(items: list[str], flags=()) -> list[tuple[str, str]]:
    """`--section.key=value` or `--section.key value` words → (key, value) pairs; `flags` for suggestions."""
    out, words = [], iter(items)
    for word in words:
        if not word.startswith("--") or "." not in word.split("=")[0]:
            hint = did_you_mean(word.split("=")[0], flags)
            raise FourdError(
                f"unrecognised argument {word!r}{hint}: overrides look like --section.key=value"
            )
        key, eq, value = word[2:].partition("=")
        key = key.replace("-", "_")  # --fault.kill-rank is --fault.kill_rank
        given = value if eq else next(words, None)
        if given is None:
            raise FourdError(f"--{key} needs a value: --{key}=VALUE")
        out.append((key, given))
    return out


def build_config(
    toml: str | None, flags: dict, overrides: list[str], base: dict | None = None, options=()
) -> Config:
    """The configuration from its layers (module docstring); `options`: the command's flags, for suggestions."""
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
    t, f = cfg.train, cfg.fault
    if t.min_lr > t.lr:
        raise FourdError(f"train.min_lr = {t.min_lr} is above train.lr = {t.lr}: lower it")
    # an "auto" layout is checked again once the planner has chosen it
    world = parse_layout(cfg.parallel.layout).world if cfg.parallel.layout != "auto" else 1 << 62
    for key in ("kill_rank", "hang_rank"):
        rank = getattr(f, key)
        if rank >= world:
            raise FourdError(
                f"fault.{key} = {rank} is not a rank of the {world}-rank layout: choose 0 .. {world - 1}"
            )
        if rank >= 0 and not 1 <= f.at_step <= t.steps:
            raise FourdError(
                f"fault.{key} needs fault.at_step, a step in 1 .. {t.steps} (it is {f.at_step})"
            )
    if f.at_step >= 0 and f.kill_rank < 0 and f.hang_rank < 0:
        raise FourdError(
            "fault.at_step is set but neither fault.kill_rank nor fault.hang_rank: set one, or drop it"
        )


def model_config(cfg: Config) -> ModelConfig:
    over = {
        k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "preset" and v is not None
    }
    model = with_overrides(get_preset(cfg.model.preset), **over)
    if cfg.data.seq_len > model.max_seq:
        raise FourdError(
            f"data.seq_len = {cfg.data.seq_len} is longer than the model's max_seq = {model.max_seq}: "
            f"raise --model.max_seq or shorten data.seq_len"
        )
    return model


def parallelism(cfg: Config) -> Parallelism:
    """The run's Parallelism, in the words the planner uses too."""
    p, lay = cfg.parallel, parse_layout(cfg.parallel.layout)
    cuts = (
        p.schedule,
        p.microbatches,
        p.virtual_stages,
        p.zero,
        p.recompute,
        p.sequence_parallel,
        p.hsdp_replicas,
    )
    return Parallelism(lay, *cuts)
