"""The private PyTorch APIs fourd relies on, in one place; tests/test_compat.py fails naming the API
that a torch upgrade changed. Import them from here, never from torch directly."""

from __future__ import annotations

from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
)

__all__ = ["replicate", "flatten_mesh", "concatenate_meshes", "pipeline_runtime"]


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The dimensions of `mesh` (a slice of the job's mesh) as one dimension named `name`."""
    return mesh._flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """1-D slices of the same job's mesh side by side as one mesh."""
    return DeviceMesh._concatenate(meshes)


def pipeline_runtime(
    stages: list, microbatches: int, loss_fn, actions: dict[int, list[tuple[int, str, int]]]
):
    """torch.distributed.pipelining's runtime running exactly `actions` ({rank: [(stage, kind,
    microbatch)]}), with the sends, receives and FSDP steps it inserts; gradients divided by the
    microbatch count after the last backward."""
    runtime = _PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn, scale_grads=True)
    runtime._prepare_schedule_with_comms(
        {
            rank: [
                _Action(stage, _ComputationType(kind), microbatch)
                for stage, kind, microbatch in rank_actions
            ]
            for rank, rank_actions in actions.items()
        }
    )
    return runtime
