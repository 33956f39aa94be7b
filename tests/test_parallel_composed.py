"""PP and CP composed with TP (+SP) and FSDP as the trainer wires them, up to all four dimensions on 16 ranks,
equal the single-process run: losses, gradient norms (clipping active) and final full parameters within
1e-5 relative, FP32, gloo."""

import pytest
import torch
import torch.distributed as dist
from dist_util import run_ranks
from torch.distributed.tensor import DTensor

from fourd.layout import Layout
from fourd.model.config import get_preset, with_overrides
from fourd.model.llama import build_model
from fourd.parallel.cp import apply_cp, cp_shard
from fourd.parallel.dp import apply_dp
from fourd.parallel.grad import clip_grad_norm
from fourd.parallel.mesh import build_mesh, dp_cp_mesh
from fourd.parallel.pp import PipelineRunner, pipeline_split
from fourd.parallel.tp import apply_tp, loss_fn
from fourd.schedules import build_schedule

pytestmark = pytest.mark.slow  # gloo ranks

CFG = with_overrides(get_preset("debug"), layers=8)
SEQ, STEPS, LR, MAX_NORM = 32, 3, 1e-3, 0.3

# (layout, schedule, virtual stages, microbatches per dp rank, ZeRO stage, sequence parallel)
CASES = {
    "pp=2,dp=2 zero3 1f1b": (Layout(pp=2, dp=2), "1f1b", 1, 2, 3, False),
    "pp=2,dp=2 zero2 zero-bubble": (Layout(pp=2, dp=2), "zero-bubble", 1, 3, 2, False),
    "pp=2,dp=2 ddp interleaved": (Layout(pp=2, dp=2), "interleaved", 2, 2, 0, False),
    "tp=2,pp=2 sp gpipe": (Layout(tp=2, pp=2), "gpipe", 1, 2, None, True),
    "tp=2,cp=2 sp zero2": (Layout(tp=2, cp=2), None, 1, 1, 2, True),
    "cp=2,pp=2 zero3 1f1b": (Layout(cp=2, pp=2), "1f1b", 1, 3, 3, False),
}


def _batch(size):
    tokens = torch.randint(
        0, CFG.vocab, (STEPS, size, SEQ + 1), generator=torch.Generator().manual_seed(5)
    )
    return tokens[..., :-1], tokens[..., 1:]


def _reference(size):
    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, norms = [], []
    for x, y in zip(*_batch(size)):
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(clip_grad_norm(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(layout, schedule_name, v, m, zero, sp):
    mesh = build_mesh(layout)
    c = layout.coords(dist.get_rank())
    runner = None
    if layout.pp > 1:
        schedule = build_schedule(schedule_name, layout.pp, m, v)
        stages = pipeline_split(CFG, c["pp"], schedule, seed=0)
    else:
        stages = [build_model(CFG, seed=0)]
    group_mesh = dp_cp_mesh(mesh) if layout.dp * layout.cp > 1 else None
    for s in stages:
        if layout.tp > 1:
            apply_tp(s, mesh["tp"], sequence_parallel=sp)
        if layout.cp > 1:
            apply_cp(s, mesh["cp"], SEQ)
        if group_mesh is not None:
            apply_dp(s, group_mesh, zero)
    if layout.pp > 1:
        runner = PipelineRunner(stages, schedule, mesh["pp"], loss_fn)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    losses, norms = [], []
    for x, y in zip(*_batch(m * layout.dp)):
        x, y = (cp_shard(t[c["dp"] * m : (c["dp"] + 1) * m], c["cp"], layout.cp) for t in (x, y))
        if runner is not None:
            loss = runner.step(x, y)
        else:
            loss = loss_fn(stages[0](x), y)
            loss.backward()
            loss = loss.detach()
        norms.append(clip_grad_norm(params, MAX_NORM, mesh))
        opt.step()
        opt.zero_grad()
        if group_mesh is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group_mesh.get_group())
        losses.append(loss.item())
    full = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for s in stages
        for n, p in s.named_parameters()
    }
    return losses, norms, full


def _four_ranks(rank, world):
    return {name: _run(*case) for name, case in CASES.items()}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.timeout(240)
def test_pp_and_cp_compose_with_tp_and_fsdp():
    refs = {}
    for layout, _, _, m, _, _ in CASES.values():
        size = m * layout.dp
        refs.setdefault(size, _reference(size))
    assert all(r[1][0] > MAX_NORM for r in refs.values()), "clipping must be active"
    per_rank = run_ranks(_four_ranks, 4, timeout=230)
    for name, (layout, _, _, m, _, _) in CASES.items():
        r_losses, r_norms, r_params = refs[m * layout.dp]
        merged = {}
        for rank, results in enumerate(per_rank):
            losses, norms, params = results[name]
            for a, b in zip(losses + norms, r_losses + r_norms):
                assert abs(a - b) <= 1e-5 * abs(b), (
                    f"{name} rank {rank}: {losses}, {norms} vs {r_losses}, {r_norms}"
                )
            for n, p in params.items():
                assert _rel(p, r_params[n]) <= 1e-5, (
                    f"{name} rank {rank} {n}: {_rel(p, r_params[n]):.2e}"
                )
            merged.update(params)
        assert merged.keys() == r_params.keys(), name


FOUR_D = (Layout(tp=2, cp=2, pp=2, dp=2), "1f1b", 1, 2, 2, True)


def _sixteen_ranks(rank, world):
    return _run(*FOUR_D)


@pytest.mark.timeout(240)
def test_all_four_dimensions_on_sixteen_ranks():
    layout, _, _, m, _, _ = FOUR_D
    r_losses, r_norms, r_params = _reference(m * layout.dp)
    merged = {}
    for rank, (losses, norms, params) in enumerate(run_ranks(_sixteen_ranks, 16, timeout=230)):
        for a, b in zip(losses + norms, r_losses + r_norms):
            assert abs(a - b) <= 1e-5 * abs(b), (
                f"rank {rank}: {losses}, {norms} vs {r_losses}, {r_norms}"
            )
        for n, p in params.items():
            assert _rel(p, r_params[n]) <= 1e-5, f"rank {rank} {n}: {_rel(p, r_params[n]):.2e}"
        merged.update(params)
    assert merged.keys() == r_params.keys()
