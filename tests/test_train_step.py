"""The optimizer of train/step.py: which parameters decay, and the multi-tensor AdamW against the per-parameter one."""

from contextlib import nullcontext

import pytest
import torch

from fourd.config import Config, set_value
from fourd.model.config import get_preset
from fourd.parallel.apply import build_parallel
from fourd.parallel.grad import clip_grad_norm
from fourd.train.step import build_optimizer, param_groups, train_step


def _setup(**over):
    cfg = Config()
    for key, value in (
        {"model.preset": "debug", "data.seq_len": 32, "train.global_batch": 4} | over
    ).items():
        set_value(cfg, key, value)
    par = build_parallel(cfg, torch.device("cpu"), 0, 1)
    return cfg, par


def test_norm_weights_and_only_they_skip_weight_decay():
    cfg, par = _setup(**{"train.weight_decay": 0.1, "train.lr": 1.0})
    decay, no_decay = param_groups(par.stages, 0.1)
    names = {id(p): n for n, p in par.stages[0].named_parameters()}
    layers = get_preset("debug").layers
    assert sorted(names[id(p)] for p in no_decay["params"]) == sorted(
        [f"layers.{i}.{n}.weight" for i in range(layers) for n in ("attention_norm", "ffn_norm")]
        + ["norm.weight"]
    )
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert len(decay["params"]) == 2 + 7 * layers  # embedding, output, and 7 matrices per layer
    # With zero gradients AdamW's update is 0 / (0 + eps) = 0: only decay moves a weight. lr = 1, decay 0.1: every
    # matrix shrinks by exactly (1 - 0.1), every norm weight stays 1.
    opt = build_optimizer(par, cfg)
    before = {n: p.detach().clone() for n, p in par.stages[0].named_parameters()}
    for p in par.stages[0].parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in par.stages[0].named_parameters():
        want = before[n] if n.endswith("norm.weight") else before[n] * 0.9
        assert torch.equal(p.detach(), want), n


def test_multi_tensor_adamw_equals_the_per_parameter_one():
    cfg, par = _setup()
    opt = build_optimizer(par, cfg)
    assert opt.defaults["foreach"] is True  # on CPU; fused on CUDA
    _, ref_par = _setup()
    t = cfg.train
    ref = torch.optim.AdamW(
        param_groups(ref_par.stages, t.weight_decay),
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=1e-8,
        foreach=False,
    )
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    for step in range(1, 6):
        a = train_step(par, opt, x[:, :-1], x[:, 1:], 1e-2 * step, cfg, nullcontext)
        b = train_step(ref_par, ref, x[:, :-1], x[:, 1:], 1e-2 * step, cfg, nullcontext)
        assert a[0] == pytest.approx(b[0], rel=1e-6) and a[1] == pytest.approx(b[1], rel=1e-6)
    for (n, p), q in zip(par.stages[0].named_parameters(), ref_par.stages[0].parameters()):
        assert ((p - q).norm() / q.norm()).item() < 1e-6, n


def test_clipping_scales_every_gradient_to_the_bound():
    _, par = _setup()
    model = par.stages[0]
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(2))
    torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    norm = torch.cat([g.flatten() for g in before]).norm().item()
    assert clip_grad_norm(model.parameters(), 2 * norm) == pytest.approx(
        norm, rel=1e-6
    )  # under the bound: untouched
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
    assert clip_grad_norm(model.parameters(), norm / 4) == pytest.approx(norm, rel=1e-6)
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, g * (norm / 4) / (norm + 1e-6), rtol=1e-6, atol=0)
    assert torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item() == pytest.approx(
        norm / 4, rel=1e-5
    )
