"""The signatures fourd relies on in the private PyTorch APIs behind fourd/compat.py (and the pipeline stage methods
fourd overrides): when a torch upgrade changes one, this fails naming it."""

import inspect

import pytest
import torch

from fourd import compat


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_private_apis_have_the_shape_fourd_uses():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.schedules import (
        _Action,
        _ComputationType,
        _PipelineScheduleRuntime,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase

    checks = {
        "torch.distributed._composable.replicate_with_fsdp.replicate(module, mesh=, mp_policy=)": {
            "mesh",
            "mp_policy",
        }
        <= set(_params(compat.replicate)),
        "DeviceMesh._flatten(mesh_dim_name)": _params(DeviceMesh._flatten)[:2]
        == ["self", "mesh_dim_name"],
        "DeviceMesh._concatenate(device_mesh_list)": len(_params(DeviceMesh._concatenate)) == 1,
        "_PipelineScheduleRuntime(stages, n_microbatches, loss_fn=, scale_grads=)": {
            "stages",
            "n_microbatches",
            "loss_fn",
            "scale_grads",
        }
        <= {
            name
            for cls in _PipelineScheduleRuntime.__mro__
            if "__init__" in vars(cls)
            for name in _params(cls.__init__)
        },
        "_PipelineScheduleRuntime._prepare_schedule_with_comms(actions)": hasattr(
            _PipelineScheduleRuntime, "_prepare_schedule_with_comms"
        ),
        "_ComputationType('F' | 'B' | 'I' | 'W')": [_ComputationType(k).value for k in "FBIW"]
        == list("FBIW"),
        "_Action(stage_index, computation_type, microbatch_index)": _Action._fields[:3]
        == ("stage_index", "computation_type", "microbatch_index"),
        "PipelineStage.forward_one_chunk(fwd_chunk_id, *args, **kwargs)": _params(
            _PipelineStageBase.forward_one_chunk
        )[:2]
        == ["self", "fwd_chunk_id"],
        "PipelineStage.backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)": _params(
            _PipelineStageBase.backward_one_chunk
        )
        == ["self", "bwd_chunk_id", "loss", "full_backward", "last_backward"],
        "PipelineStage.backward_weight_one_chunk(bwd_chunk_id, last_backward)": _params(
            _PipelineStageBase.backward_weight_one_chunk
        )[:3]
        == ["self", "bwd_chunk_id", "last_backward"],
        "torch.ops._c10d_functional.all_reduce / reduce_scatter_tensor (selective recomputation keeps them)": all(
            hasattr(torch.ops._c10d_functional, op)
            for op in ("all_reduce", "reduce_scatter_tensor")
        ),
    }
    changed = [api for api, ok in checks.items() if not ok]
    assert not changed, (
        f"torch {torch.__version__} changed: {'; '.join(changed)} (adapt fourd/compat.py)"
    )


@pytest.mark.parametrize("kind", ["F", "B", "I", "W"])
def test_fourd_schedule_actions_become_runtime_actions(kind):
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    action = _Action(1, _ComputationType(kind), 2)
    assert (action.stage_index, action.computation_type.value, action.microbatch_index) == (
        1,
        kind,
        2,
    )
