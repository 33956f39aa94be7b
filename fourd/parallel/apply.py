"""The layout's parallelism applied from outside to the unmodified model, in one order: pipeline split → TP →
CP → DP (FSDP over dp×cp). This is the one place that order is written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fourd.config import Config, model_config, parallelism
from fourd.errors import FourdError
from fourd.layout import Layout
from fourd.model.llama import build_model


@dataclass
class Parallel:
    """This rank's place in the layout and the pieces that run its part of the model."""

    layout: Layout
    rank: int
    coords: dict
    mesh: object | None
    stages: list[torch.nn.Module]
    runner: Any  # the pipeline executor (PipelineRunner) when pp > 1, else None

    @property
    def data_rank(self) -> int:
        return self.coords["dp"]


def build_parallel(cfg: Config, device: torch.device, rank: int, world: int) -> Parallel:
    layout = parallelism(cfg).layout
    if layout.world != world:
        raise FourdError(
            f"layout {layout} needs {layout.world} ranks but {world} were started: "
            f"start {layout.world} workers or change --layout"
        )
    mcfg = model_config(cfg)
    coords = layout.coords(rank)
    seed = cfg.train.seed
    if world == 1:
        model = build_model(mcfg, seed=seed, device=device)
        return Parallel(layout, rank, coords, None, [model], None)

    from fourd.parallel.mesh import build_mesh, dp_cp_mesh

    hsdp = cfg.parallel.hsdp_replicas if cfg.parallel.hsdp_replicas > 1 else None
    mesh = build_mesh(layout, device.type, hsdp_replicate=hsdp)
    runner = None
    if layout.pp > 1:
        from fourd.parallel.pp import pipeline_split
        from fourd.schedules import build_schedule

        schedule = build_schedule(
            cfg.parallel.schedule, layout.pp, cfg.parallel.microbatches, cfg.parallel.virtual_stages
        )
        stages = pipeline_split(mcfg, coords["pp"], schedule, seed=seed, device=device)
    else:
        schedule = None
        stages = [build_model(mcfg, seed=seed, device=device)]
    if layout.tp > 1:
        from fourd.parallel.tp import apply_tp

        for s in stages:
            apply_tp(s, mesh["tp"], sequence_parallel=cfg.parallel.sequence_parallel)
    if layout.cp > 1:
        from fourd.parallel.cp import apply_cp

        for s in stages:
            apply_cp(s, mesh["cp"], cfg.data.seq_len)
    group_mesh = None
    if layout.dp * layout.cp > 1:
        from fourd.parallel.dp import apply_dp

        group_mesh = dp_cp_mesh(mesh)
        for s in stages:
            apply_dp(s, group_mesh, _dp_mode(cfg))
    if schedule is not None:
        from fourd.parallel.pp import PipelineRunner

        runner = PipelineRunner(stages, schedule, mesh["pp"], loss_fn(layout), device=device)
    return Parallel(layout, rank, coords, mesh, stages, runner)


def _dp_mode(cfg: Config) -> str:
    zero = cfg.parallel.zero
    if zero == 1:
        raise FourdError("ZeRO stage 1 is not implemented yet: use parallel.zero = 0, 2 or 3")
    return {0: "ddp", 2: "zero2", 3: "hsdp" if cfg.parallel.hsdp_replicas > 1 else "zero3"}[zero]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss in nats (float32 whatever the compute dtype)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def loss_fn(layout: Layout):
    if layout.tp > 1:
        from fourd.parallel.tp import loss_fn as vocab_parallel_loss

        return vocab_parallel_loss
    return cross_entropy
