"""The run's parallelism applied from outside to the unmodified model, in the one order this module
writes: pipeline split → (FP8) → TP → CP → recomputation → compilation → DP (FSDP over dp×cp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fourd.config import Config, model_config, parallelism
from fourd.errors import FourdError
from fourd.layout import Layout, Parallelism
from fourd.model.llama import build_model
from fourd.parallel.cp import apply_cp
from fourd.parallel.dp import apply_dp
from fourd.parallel.mesh import build_mesh, dp_cp_mesh
from fourd.parallel.pp import PipelineRunner, pipeline_split
from fourd.parallel.recompute import apply_recompute
from fourd.parallel.tp import apply_tp

# the loss of logits plain, or sharded on the vocabulary by TP
from fourd.parallel.tp import loss_fn as cross_entropy
from fourd.schedules import build_schedule


@dataclass(kw_only=True)
class Parallel:
    """This rank's place in the layout and the pieces that run its part of the model."""

    setting: Parallelism
    rank: int
    coords: dict
    mesh: Any  # the job's DeviceMesh; None on one rank
    stages: list[torch.nn.Module]
    runner: Any  # the pipeline executor (PipelineRunner) when pp > 1, else None
    dp_mesh: Any = None  # the dp×cp mesh that averages gradients, when there is one

    @property
    def layout(self) -> Layout:
        return self.setting.layout


def build_parallel(cfg: Config, device: torch.device, rank: int, world: int) -> Parallel:
    par = parallelism(cfg)
    layout = par.layout
    mcfg = model_config(cfg)
    seed = cfg.train.seed
    if layout.world != world:
        raise FourdError(
            f"layout {layout} needs {layout.world} ranks but {world} were started: "
            f"start {layout.world} workers or change the layout"
        )
    coords = layout.coords(rank)
    schedule = None
    mesh: Any = None  # one rank needs no mesh: every degree is 1
    hsdp_replicate = None
    if par.hsdp:
        hsdp_replicate = par.hsdp_replicas
    if world > 1:
        mesh = build_mesh(layout, device.type, hsdp_replicate=hsdp_replicate)
    if layout.pp > 1:
        schedule = build_schedule(par.schedule, layout.pp, par.microbatches, par.virtual_stages)
        stages = pipeline_split(mcfg, coords["pp"], schedule, seed=seed, device=device)
    else:
        stages = [build_model(mcfg, seed=seed, device=device)]
    dp_mesh = None  # no gradients to average: one DP replica, one CP rank
    if par.grad_ranks > 1:
        dp_mesh = dp_cp_mesh(mesh)
    for stage in stages:
        if cfg.train.fp8:
            _fp8(stage)
        if layout.tp > 1:
            apply_tp(stage, mesh["tp"], sequence_parallel=par.sequence_parallel)
        if layout.cp > 1:
            apply_cp(stage, mesh["cp"], cfg.data.seq_len)
        _per_block(cfg, stage, par, device)
        if dp_mesh is not None:
            apply_dp(stage, dp_mesh, par.zero)
    return Parallel(
        setting=par,
        rank=rank,
        coords=coords,
        mesh=mesh,
        stages=stages,
        runner=_pipeline_runner(stages, schedule, mesh, device),
        dp_mesh=dp_mesh,
    )


def _pipeline_runner(stages: list, schedule: Any, mesh: Any, device: torch.device) -> Any:
    """The executor that runs this rank's stages on the pipeline schedule; None without pipeline
    parallelism (no schedule: one stage, run directly)."""
    if schedule is None:
        return None
    return PipelineRunner(stages, schedule, mesh["pp"], cross_entropy, device=device)


def _per_block(cfg: Config, stage: torch.nn.Module, par: Parallelism, device: torch.device) -> None:
    """Recomputation, then compilation of each block in place, as torchtitan does (parameter names
    unchanged)."""
    apply_recompute(stage, par.recompute)
    if compiles(cfg, device.type):
        for block in stage.layers.values():
            block.compile()


def compiles(cfg: Config, device_type: str) -> bool:
    """train.compile, by default on CUDA only (compiling takes tens of seconds on a CPU)."""
    if cfg.train.compile is not None:
        return cfg.train.compile
    return device_type == "cuda"


def check_fp8(cfg: Config) -> None:
    """FourdError unless FP8 training (torchao's float8 linears) can run here: a CUDA H100 or H200,
    no TP."""
    if not cfg.train.fp8:
        return
    name = "no CUDA device"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    if not any(gpu in name for gpu in ("H100", "H200")) or cfg.train.dtype == "fp32":
        raise FourdError(
            f"train.fp8 needs a CUDA H100 or H200 training in bf16, found {name}: drop train.fp8"
        )
    if parallelism(cfg).layout.tp > 1:
        raise FourdError(
            "train.fp8 with tensor parallelism is not implemented: use tp=1 or drop train.fp8"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise FourdError(
            "train.fp8 needs torchao: install fourd's gpu extra (pip install 'fourd[gpu]')"
        ) from None


def fp8_converts(module: torch.nn.Module, fqn: str) -> bool:
    """Whether FP8 training converts this linear layer of a stage (torchao's `module_filter_fn`):
    every one but the output projection, which stays in BF16 since its FP8 error reaches the loss
    directly (torchtitan does the same)."""
    return isinstance(module, torch.nn.Linear) and fqn != "output"


def _fp8(stage: torch.nn.Module) -> None:
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(stage, module_filter_fn=fp8_converts)
