"""Pipeline parallelism: split the model into stages by layer count and run a `fourd.schedules`
schedule, its per-rank action lists unchanged, on torch.distributed.pipelining's action runtime
(docs/pipeline-context.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from time import perf_counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from fourd.compat import pipeline_runtime
from fourd.layout import layer_split
from fourd.model.config import ModelConfig
from fourd.model.llama import Llama, Rope
from fourd.schedules import Schedule


def pipeline_split(
    model_or_cfg: Llama | ModelConfig,
    pp_rank: int,
    schedule: Schedule,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    fewer_first_last: bool = True,
) -> list[Llama]:
    """Pipeline rank `pp_rank`'s stages (Llama with only their layers, global keys) in schedule
    order: sharing a built model's modules, or built alone from `seed` (the full model's weights:
    init is per parameter name)."""
    cfg = model_or_cfg
    if isinstance(model_or_cfg, Llama):
        cfg = model_or_cfg.cfg
    counts = layer_split(cfg.layers, schedule.stages, fewer_first_last, empty_edges=True)
    starts = [sum(counts[:index]) for index in range(schedule.stages)]
    out = []
    for index in schedule.stages_of_rank(pp_rank):
        keep = {str(i) for i in range(starts[index], starts[index] + counts[index])}
        with torch.device("meta"):
            stage = Llama(cfg)
        for key in [k for k in stage.layers if k not in keep]:
            del stage.layers[key]
        if index != 0:
            stage.tok_embeddings = None
        if index != schedule.stages - 1:
            stage.norm = stage.output = None
        if isinstance(model_or_cfg, Llama):
            for key in keep:
                stage.layers[key] = model_or_cfg.layers[key]
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(stage, name) is not None:
                    setattr(stage, name, getattr(model_or_cfg, name))
            device = model_or_cfg.rope.cos.device
        else:
            stage.to_empty(device=device)
            stage.init_weights(seed)
        # Its own rope table: context parallelism replaces it with the rank's rows, per stage.
        with torch.device(device):
            stage.rope = Rope(cfg.head_dim, cfg.max_seq, cfg.rope_theta)
        out.append(stage)
    return out


@dataclass(frozen=True, kw_only=True)
class ActionRecord:
    kind: str  # "F", "B", "I" or "W" as in fourd.schedules (the last stage's F includes its loss)
    stage: int
    microbatch: int
    start: float  # seconds from the start of the step
    end: float


class _TimedStage(PipelineStage):
    """A PipelineStage that records when each of its compute actions starts and ends."""

    def __init__(self, *args, log: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log
        self.t0 = 0.0

    def _timed(self, kind, microbatch, call, *args, **kwargs):
        start = perf_counter()
        out = call(microbatch, *args, **kwargs)
        record = ActionRecord(
            kind=kind,
            stage=self.stage_index,
            microbatch=microbatch,
            start=start - self.t0,
            end=perf_counter() - self.t0,
        )
        self.log.append(record)
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._timed("F", fwd_chunk_id, super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        kind = "I"  # the input gradient alone (zero bubble), W later
        if full_backward:
            kind = "B"
        return self._timed(
            kind, bwd_chunk_id, super().backward_one_chunk, loss, full_backward, last_backward
        )

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return self._timed("W", bwd_chunk_id, super().backward_weight_one_chunk, last_backward)


class PipelineRunner:
    """Runs one training step of `schedule` over this rank's `stages`; after it, `records` (its
    compute actions), `wall` (the step's seconds) and `bubble_fraction` = 1 − busy / wall."""

    def __init__(self, stages: list[nn.Module], schedule: Schedule, pp_mesh, loss_fn, device=None):
        self.group = pp_mesh  # a process group, or a mesh of one
        if hasattr(pp_mesh, "get_group"):
            self.group = pp_mesh.get_group()
        self.schedule = schedule
        self.rank = dist.get_rank(self.group)
        indices = schedule.stages_of_rank(self.rank)
        assert dist.get_world_size(self.group) == schedule.pp and len(stages) == len(indices), (
            "use pipeline_split"
        )
        self.records: list[ActionRecord] = []
        self.wall = 0.0
        self.bubble_fraction = 0.0
        self._loss_fn = loss_fn
        if device is not None:
            device = torch.device(device)
        self._stages = [
            _TimedStage(
                module,
                stage,
                schedule.stages,
                device or _device_of(module),
                group=self.group,
                log=self.records,
            )
            for module, stage in zip(stages, indices)
        ]
        self._has_first = 0 in indices
        self._has_last = schedule.stages - 1 in indices
        # Each microbatch's mean loss counts 1/M: the runtime divides the gradients by M once all
        # backwards are done (after FSDP's reduction), which is the same as backpropagating loss /
        # M.
        actions = {
            rank: [(action.stage, action.kind, action.microbatch) for action in acts]
            for rank, acts in enumerate(schedule.ranks)
        }
        self._runtime = pipeline_runtime(
            self._stages, schedule.microbatches, self._timed_loss, actions
        )

    def _timed_loss(self, output, target):
        start = perf_counter()
        loss = self._loss_fn(output, target)
        # The loss belongs to the forward action that produced `output`, which was just recorded
        # (no record yet when the runtime infers shapes before the first step).
        if self.records:
            self.records[-1] = replace(
                self.records[-1], end=self.records[-1].end + perf_counter() - start
            )
        return loss

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of every microbatch of x, y ([batch, seq], a multiple of the
        microbatches; read on the first / last stage's rank only); returns the mean loss (detached
        FP32, the same on every rank)."""
        self.records.clear()
        # The step is one window for the whole pipeline: from all ranks starting together to the
        # last one finishing. A rank's own window would hide the fill (later stages wait before
        # their first F) or the drain (the last stage is done before the first stage's final B).
        dist.barrier(group=self.group)
        began = perf_counter()
        for stage in self._stages:
            stage.t0 = began
        losses: list[torch.Tensor] = []
        inputs: tuple = ()  # only the first stage takes the tokens, only the last the targets
        if self._has_first:
            inputs = (x,)
        target = None
        if self._has_last:
            target = y
        self._runtime.step(*inputs, target=target, losses=losses, return_outputs=False)
        device = self._stages[0].device
        # Only the last stage's rank has losses; the others add zero, and everyone waits for the
        # last rank.
        loss = torch.zeros((), device=device)
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        dist.all_reduce(loss, group=self.group)
        self.wall = perf_counter() - began
        busy = sum(record.end - record.start for record in self.records)
        self.bubble_fraction = max(0.0, 1.0 - busy / self.wall)
        return loss


def _device_of(module: nn.Module) -> torch.device:
    param = next(module.parameters())
    if hasattr(param, "to_local"):
        return param.to_local().device
    return param.device
