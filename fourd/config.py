"""Training configuration: dataclasses, TOML files, and `--section.key=value` overrides.

Precedence, lowest first: the dataclass defaults, the TOML file (`--config`), the short flags
(`--model`, `--layout`, `--steps`, ...), then `--section.key=value` overrides. Unknown keys and values of
the wrong type are refused with one line naming the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from fourd.errors import FourdError
from fourd.layout import PRECISIONS, RECOMPUTE, ZERO_STAGES, Parallelism, parse_layout
from fourd.schedules import SCHEDULES


def fourd_home() -> Path:
    """$FOURD_HOME (unset or empty: ~/.fourd): the token cache, measured profiles, user cluster profiles."""
    return Path(os.environ.get("FOURD_HOME") or "~/.fourd").expanduser()


@dataclass
class ModelSection:
    preset: str = "small"
    # Any ModelConfig field may be overridden on top of the preset, e.g. `--model.layers=2`.
    layers: int | None = None
    dim: int | None = None
    ffn: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    vocab: int | None = None
    max_seq: int | None = None


@dataclass
class DataSection:
    path: str = ""  # empty: the running interpreter's standard library (no download)
    tokenizer: str = "byte"  # "byte", or a local tokenizer.json / tiktoken BPE file
    seq_len: int = 256
    cache_dir: str = ""  # empty: $FOURD_HOME/cache (FOURD_HOME defaults to ~/.fourd)
    holdout_fraction: float = 0.01  # the corpus tail kept out of training, for evaluation


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
    timeout_s: float = 300.0  # collective timeout: a hung rank fails the step instead of the job hanging


@dataclass
class ParallelSection:
    layout: str = "dp=1"
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    zero: int = 2  # ZeRO stage over the dp×cp ranks: 0 replicates (DDP), 1 shards optimizer state, 2 and
    # gradients, 3 and weights
    hsdp_replicas: int = 1  # more than one (with zero = 3): HSDP, ZeRO 3 inside each of this many groups
    recompute: str = "none"  # none, selective or full: what each layer keeps for backward
    sequence_parallel: bool = False


@dataclass
class CheckpointSection:
    interval: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 3
    async_save: bool = False


@dataclass
class FaultSection:
    kill_rank: int = -1
    at_step: int = -1
    hang_rank: int = -1


@dataclass
class RunSection:
    dir: str = "runs/latest"
    max_restarts: int = 0
    trace: bool = True  # with a pipeline: DIR/trace.json, the last step's actions on every rank (Chrome trace)


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    fault: FaultSection = field(default_factory=FaultSection)
    run: RunSection = field(default_factory=RunSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        cfg = cls()
        for section, values in d.items():
            for key, value in values.items():
                set_value(cfg, f"{section}.{key}", value)
        return cfg


CHOICES = {
    "parallel.schedule": SCHEDULES,
    "parallel.zero": ZERO_STAGES,
    "parallel.recompute": RECOMPUTE,
    "train.dtype": ("auto", *PRECISIONS),
}


def _sections(cfg: Config) -> dict[str, object]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _coerce(key: str, value, hint) -> object:
    base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    want = base[0]
    if value is None and type(None) in typing.get_args(hint):
        return None
    try:
        if want is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if want is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if want is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise FourdError(f"{key} = {value!r} is not a valid {want.__name__}") from None


def set_value(cfg: Config, key: str, value) -> None:
    section_name, dot, name = key.partition(".")
    sections = _sections(cfg)
    if not dot or section_name not in sections:
        raise FourdError(f"unknown config key {key!r}: sections are {', '.join(sections)} (use section.key)")
    section = sections[section_name]
    hints = typing.get_type_hints(type(section))
    if name not in hints:
        raise FourdError(f"unknown config key {key!r}: allowed keys in [{section_name}] are {', '.join(hints)}")
    value = _coerce(key, value, hints[name])
    allowed = CHOICES.get(key)
    if allowed and value not in allowed:
        raise FourdError(f"{key} = {value!r}: allowed values are {', '.join(map(str, allowed))}")
    setattr(section, name, value)


def load_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FourdError(f"config file {str(p)!r} does not exist: give the path of a TOML file")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FourdError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def parse_overrides(items: list[str]) -> list[tuple[str, str]]:
    """`--section.key=value` or `--section.key value` words → (key, value) pairs."""
    out, i = [], 0
    while i < len(items):
        word = items[i]
        if not word.startswith("--") or "." not in word.split("=")[0]:
            raise FourdError(f"unrecognised argument {word!r}: overrides look like --section.key=value")
        key, eq, value = word[2:].partition("=")
        key = key.replace("-", "_")  # --fault.kill-rank is --fault.kill_rank, as the contract spells it
        if not eq:
            if i + 1 >= len(items):
                raise FourdError(f"--{key} needs a value: --{key}=VALUE")
            value, i = items[i + 1], i + 1
        out.append((key, value))
        i += 1
    return out


def build_config(toml_path: str | None, flags: dict[str, object], overrides: list[str]) -> Config:
    cfg = Config()
    if toml_path:
        data = load_toml(toml_path)
        for section, values in data.items():
            if not isinstance(values, dict):
                raise FourdError(f"config file: top-level key {section!r} must be a [section] table")
            for key, value in values.items():
                set_value(cfg, f"{section}.{key}", value)
    for key, value in flags.items():
        if value is not None:
            set_value(cfg, key, value)
    for key, value in parse_overrides(overrides):
        set_value(cfg, key, value)
    check(cfg)
    return cfg


def check(cfg: Config) -> None:
    """Value ranges that no single field type expresses."""
    positive = (
        "train.steps",
        "train.global_batch",
        "data.seq_len",
        "parallel.microbatches",
        "parallel.virtual_stages",
        "checkpoint.keep",
        "train.log_every",
    )
    for key in positive:
        s, n = key.split(".")
        if getattr(getattr(cfg, s), n) < 1:
            raise FourdError(f"{key} = {getattr(getattr(cfg, s), n)} must be at least 1")
    if cfg.train.lr <= 0 or cfg.train.min_lr < 0 or cfg.train.min_lr > cfg.train.lr:
        raise FourdError(
            f"train.lr = {cfg.train.lr} and train.min_lr = {cfg.train.min_lr}: need 0 <= min_lr <= lr, lr > 0"
        )
    if cfg.train.warmup_steps < 0 or cfg.checkpoint.interval < 0 or cfg.run.max_restarts < 0:
        raise FourdError("train.warmup_steps, checkpoint.interval and run.max_restarts must be >= 0")
    if not 0 <= cfg.data.holdout_fraction < 0.5:
        raise FourdError(f"data.holdout_fraction = {cfg.data.holdout_fraction} must be in [0, 0.5)")


def model_config(cfg: Config):
    from fourd.model.config import get_preset, with_overrides

    base = get_preset(cfg.model.preset)
    over = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "preset" and v is not None}
    model = with_overrides(base, **over)
    if cfg.data.seq_len > model.max_seq:
        model = with_overrides(model, max_seq=cfg.data.seq_len)
    return model


def parallelism(cfg: Config) -> Parallelism:
    """The run's Parallelism, in the words the planner uses too."""
    p = cfg.parallel
    return Parallelism(
        parse_layout(p.layout),
        p.schedule,
        p.microbatches,
        p.virtual_stages,
        p.zero,
        p.recompute,
        p.sequence_parallel,
        p.hsdp_replicas,
    )
