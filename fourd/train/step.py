"""One optimizer step and one evaluation step, the math apart from the loop's bookkeeping
(fourd.train.worker)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fourd.config import Config
from fourd.parallel.apply import Parallel, cross_entropy
from fourd.parallel.dp import ShardedAdamW
from fourd.parallel.grad import clip_grad_norm


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to train.lr, then cosine decay to train.min_lr at the last step (step counts
    from 1)."""
    t = cfg.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def param_groups(stages, weight_decay: float):
    """AdamW's groups: norm weights (gains, no decay toward 0) and the rest (with weight_decay)."""
    named = [(n, p) for s in stages for n, p in s.named_parameters()]
    decay, no_decay = (
        [p for n, p in named if n.endswith("norm.weight") == norm] for norm in (False, True)
    )
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(par: Parallel, cfg: Config) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA and multi-tensor (foreach) elsewhere; ZeRO 1 shards its state
    (ShardedAdamW)."""
    t = cfg.train
    groups = param_groups(par.stages, t.weight_decay)
    kw = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    kw |= {"fused": True} if next(par.stages[0].parameters()).is_cuda else {"foreach": True}
    if par.setting.zero == 1 and par.dp_mesh is not None:
        return ShardedAdamW(groups, par.dp_mesh, **kw)
    return torch.optim.AdamW(groups, **kw)


def _forward(
    par: Parallel, x: torch.Tensor, y: torch.Tensor, microbatches: int, amp, backward: bool
):
    """The rank's mean loss over its microbatches; with `backward` each one's loss / M is
    backpropagated. A pipeline runs its whole schedule, backward included, either way."""
    if par.runner is not None:
        with amp():
            return par.runner.step(x, y)
    model = par.stages[0]
    total = torch.zeros((), device=x.device)
    for i, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(i == microbatches - 1)
        with amp(), torch.set_grad_enabled(backward):
            loss = cross_entropy(model(xm), ym) / microbatches
        if backward:
            loss.backward()
        total += loss.detach()
    return total


def _global_mean(loss: torch.Tensor) -> float:
    loss = loss.detach().float().reshape(())
    if dist.is_initialized() and dist.get_world_size() > 1:
        # TP and PP ranks hold equal copies of their replica's loss: the world mean is the mean over
        # the
        # dp×cp ranks, i.e. over the global batch.
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


def train_step(par: Parallel, opt, x: torch.Tensor, y: torch.Tensor, lr: float, cfg: Config, amp):
    """Forward and backward of the rank's batch, clipping, the update: (mean loss over the global
    batch, gradient norm before clipping)."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss = _forward(par, x, y, cfg.parallel.microbatches, amp, backward=True)
    grad_norm = clip_grad_norm(
        [p for s in par.stages for p in s.parameters()], cfg.train.grad_clip, par.mesh
    )
    opt.step()
    opt.zero_grad(set_to_none=True)
    return _global_mean(loss), grad_norm


def eval_step(par: Parallel, opt, x: torch.Tensor, y: torch.Tensor, cfg: Config, amp) -> float:
    """The global batch's mean loss without an update (a pipeline's gradients are dropped)."""
    loss = _forward(par, x, y, cfg.parallel.microbatches, amp, backward=False)
    opt.zero_grad(set_to_none=True)
    return _global_mean(loss)
