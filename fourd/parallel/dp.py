"""Data parallelism over the dp×cp ranks by ZeRO stage (Rajbhandari et al. 2020), on FSDP2; the
stages, their memory and the ZeRO 1 optimizer are described in docs/parallelism.md."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fourd.compat import replicate
from fourd.errors import FourdError
from fourd.layout import ZERO_STAGES


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, zero: int = 3) -> nn.Module:
    """Wrap a Llama or a pipeline stage in place, per block and then whole: ZeRO 0 and 1 replicate
    (ZeRO 1's optimizer is ShardedAdamW), 2 and 3 fully_shard; a 2-D dp_mesh (HSDP, from
    mesh.dp_cp_mesh) takes ZeRO 3. On CUDA, compute in BF16 and gradient reduction in FP32."""
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise FourdError(f"ZeRO stage {zero!r}: choose one of {', '.join(map(str, ZERO_STAGES))}")
    if dp_mesh.ndim == 2 and zero != 3:
        raise FourdError(
            f"a 2-D (HSDP) data-parallel mesh takes ZeRO stage 3, not {zero}: build a 1-D mesh"
        )
    if dp_mesh.size() == 1:
        return model
    if dp_mesh.device_type == "cuda":
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        precision = MixedPrecisionPolicy()
    if zero < 2:
        wrap = partial(replicate, mesh=dp_mesh, mp_policy=precision)
    else:
        wrap = partial(
            fully_shard, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=precision
        )
    for block in model.layers.values():
        wrap(block)
    wrap(model)
    return model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


class ShardedAdamW(torch.optim.AdamW):
    """ZeRO 1 over replicated parameters: each parameter's AdamW state lives on one owner rank
    (largest first, to the least loaded), which updates and broadcasts it. state_dict() gathers
    every state (a collective): checkpoints equal ZeRO 0's; load_state_dict() keeps the owned."""

    def __init__(self, params, mesh: DeviceMesh, **kwargs):
        super().__init__(params, **kwargs)
        self.group, rank, loads = mesh.get_group(), mesh.get_local_rank(), [0] * mesh.size()
        self.owner: dict[torch.Tensor, int] = {}
        for param in sorted(self._params(), key=lambda param: -param.numel()):
            self.owner[param] = loads.index(min(loads))
            loads[self.owner[param]] += param.numel()
        self.mine = {param for param, owner in self.owner.items() if owner == rank}
        self.steps = 0
        # The state exists from the start, as torch.distributed.checkpoint wants to load into it;
        # never empty, even on a rank that owns nothing, or it would call step() (here a collective)
        # on that rank alone to create it.
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param] = {}
                if param in self.mine:
                    self.state[param] = self._zeros(param, group)

    def _zeros(self, param: torch.Tensor, group: dict) -> dict:
        """AdamW's state of p before its first step, as torch.optim.AdamW creates it."""
        on_device = group["fused"] or group["capturable"]
        device = "cpu"
        if on_device:
            device = param.device
        step = torch.tensor(float(self.steps), device=device)
        return {
            "step": step,
            "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": torch.zeros_like(param),
        }

    def _params(self) -> list[torch.Tensor]:
        return [param for group in self.param_groups for param in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        others = [param for param in self._params() if param not in self.mine]
        grads = [param.grad for param in others]
        for param in others:
            # AdamW skips a parameter without gradient: it neither creates nor updates its state
            param.grad = None
        try:
            super().step()
        finally:
            for param, grad in zip(others, grads):
                param.grad = grad
        self.steps += 1
        for param in self._params():
            dist.broadcast(_local(param), group=self.group, group_src=self.owner[param])

    def state_dict(self):
        owned, full = dict(self.state), {}
        for group in self.param_groups:
            for param in group["params"]:
                if param in self.mine:
                    full[param] = owned[param]
                else:
                    full[param] = self._zeros(param, group)
                for key in ("exp_avg", "exp_avg_sq"):
                    dist.broadcast(
                        _local(full[param][key]), group=self.group, group_src=self.owner[param]
                    )
        self.state.update(full)
        try:
            return super().state_dict()
        finally:
            self.state.update({param: owned[param] for param in full})

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.steps = max(
            (int(state["step"]) for state in self.state.values() if "step" in state), default=0
        )
        self.state.update({param: {} for param in self.owner if param not in self.mine})


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors' local shards (FSDP's padded): what this
    rank holds."""
    storages = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
