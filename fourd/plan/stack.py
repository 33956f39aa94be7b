"""Software-stack profiles (TOML): what a training stack does around the GEMMs that changes a step's
time, each a physical switch (which communication hides behind which compute, which kernels run),
never an efficiency of its own. Presets in fourd/plan/stacks/, user profiles in $FOURD_HOME/stacks/
(they win), or a path; docs/planner.md cites each preset's features."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import tomllib

from fourd.errors import FourdError
from fourd.plan.cluster import find_toml

PRESET_DIR = Path(__file__).parent / "stacks"
DEFAULT_STACK = "fourd"
# The values each switch takes; the first is the plainest (nothing overlapped, nothing fused).
CHOICES = {
    # TP collectives: on the critical path, or cut into chunks that a ring exchanges while the GEMM
    # that needs (or produced) them runs on the chunk before (Transformer Engine's userbuffers,
    # torch's async TP)
    "tp_overlap": ("none", "ring"),
    # data-parallel traffic: per-layer buckets hidden behind the compute around them (DDP, FSDP
    # prefetch, Megatron's distributed optimizer); only ZeRO 3's (DeepSpeed's overlap_comm default);
    # or reduced and gathered apart from compute, all exposed
    "dp_overlap": ("bucketed", "zero3", "none"),
    # pipeline sends: beside compute, or each waited for (DeepSpeed's pipeline engine)
    "pipeline_comm": ("overlapped", "blocking"),
    # the memory-bound ops between GEMMs: one kernel per op, hand-fused kernels (TE, Apex), or
    # compiled; fused and compiled move the same bytes in the planner's count (fourd.plan.block)
    "elementwise": ("eager", "fused", "compiled"),
    # attention: a fused kernel, or the s x s scores written to memory (Megatron 2021-22)
    "attention": ("flash", "materialized"),
    # the fused kernel's family: FlashAttention 2, or FlashAttention 3 / cuDNN's fused attention on
    # Hopper
    "attention_kernel": ("fa2", "fa3"),
}


@dataclass(frozen=True, kw_only=True)
class Stack:
    """One training stack's features (the fields of a stack TOML; CHOICES lists the values)."""

    name: str
    description: str = ""
    tp_overlap: str = "none"
    dp_overlap: str = "bucketed"
    pipeline_comm: str = "overlapped"
    elementwise: str = "compiled"
    attention: str = "flash"
    attention_kernel: str = "fa2"
    kernel_launch_us: float = 4.0  # the gap a GEMM's launch and tail leave on the GPU, microseconds
    cuda_graphs: bool = False  # kernels replayed from a captured graph: no launch gap between them
    source: str = ""  # the file it was read from

    @property
    def launch_s(self) -> float:
        """Seconds each GEMM's launch adds: none when CUDA graphs replay the step."""
        if self.cuda_graphs:
            return 0.0
        return self.kernel_launch_us * 1e-6

    @property
    def compiled(self) -> bool:
        """Whether the ops between GEMMs run fused (hand-fused or compiled: the same bytes)."""
        return self.elementwise != "eager"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _checked(data: dict, path: Path) -> Stack:
    """A Stack from a TOML table: every key known, every value of its type and among its choices."""
    known = {f.name: f for f in fields(Stack) if f.name != "source"}
    if bad := ", ".join(sorted(set(data) - set(known))):
        raise FourdError(f"{path}: unknown key(s) {bad}; allowed: {', '.join(sorted(known))}")
    for key, value in data.items():
        if key in CHOICES and value not in CHOICES[key]:
            raise FourdError(f"{path}: {key} = {value!r}; choose one of {', '.join(CHOICES[key])}")
        if key == "cuda_graphs" and not isinstance(value, bool):
            raise FourdError(f"{path}: cuda_graphs = {value!r} must be true or false")
        if key == "kernel_launch_us":
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value >= 0):
                raise FourdError(f"{path}: kernel_launch_us = {value!r} must be a number >= 0")
        if key in ("name", "description") and not isinstance(value, str):
            raise FourdError(f"{path}: {key} = {value!r} must be a string")
    return Stack(**{"name": path.stem, **data}, source=str(path))


@lru_cache(maxsize=64)
def load_stack(name_or_path: str) -> Stack:
    """The stack called `name_or_path` (user stacks first, then presets), or the one at a path."""
    if isinstance(name_or_path, Stack):
        return name_or_path
    path = find_toml("stack", str(name_or_path), PRESET_DIR)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise FourdError(f"{path}: not a readable TOML stack ({e}); fix it or remove it") from None
    return _checked(data, path)
