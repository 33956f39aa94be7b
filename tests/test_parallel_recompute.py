"""Recomputation keeps what the planner says it keeps and changes no number.

The bytes a layer keeps for backward are measured, not counted: every tensor storage created during the forward of
a stack of blocks and still alive after it (so held by autograd, or by the checkpoint) is summed, per token per
layer, and compared with fourd.plan.block.traffic(work).saved in FP32."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fourd.layout import Layout, Parallelism
from fourd.model.config import get_preset, with_overrides
from fourd.model.llama import build_model
from fourd.parallel.apply import cross_entropy
from fourd.parallel.recompute import apply_recompute
from fourd.plan.block import traffic
from fourd.plan.cluster import load_cluster
from fourd.plan.job import Job

CFG = get_preset("debug")


def _planned(cfg, mode):
    """The planner's bytes per token per layer of one rank, FP32, no parallelism."""
    job = Job(
        model=cfg,
        cluster=load_cluster("llama3-h100"),
        par=Parallelism(Layout(), recompute=mode),
        seq=64,
        global_seqs=2,
        precision="fp32",
    )
    return traffic(job.work).saved  # what one layer keeps for backward per token


class _Alive(TorchDispatchMode):
    """Records each storage an op creates; `bytes()` sums those still alive."""

    def __init__(self, existing):
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.existing:
                s = t.untyped_storage()
                self.made[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out

    def bytes(self):
        return sum(n for ref, n in self.made.values() if not ref.expired())


def _kept_per_token_per_layer(cfg, mode, batch=2, seq=64):
    model = apply_recompute(build_model(cfg, seed=0), mode)
    x = torch.randn(batch, seq, cfg.dim, requires_grad=True)
    cos, sin = model.rope(seq)
    alive = _Alive([x, cos, sin, *model.parameters(), *model.buffers()])
    with alive:
        h = x
        for layer in model.layers.values():
            h = layer(h, cos, sin)
    kept = alive.bytes()  # each layer's output is the next one's input; the last is held here
    h.sum().backward()
    return kept / (batch * seq * cfg.layers)


@pytest.mark.parametrize(
    "cfg", [CFG, with_overrides(CFG, ffn=96, kv_heads=1)], ids=["debug", "ffn96-mqa"]
)
def test_kept_bytes_equal_the_planners_formula(cfg):
    for mode in ("selective", "full"):
        want = _planned(cfg, mode)
        assert _kept_per_token_per_layer(cfg, mode) == want, mode
    # debug, FP32: full keeps the input (64 × 4 B); selective the norm inputs, Q, K, V, the attention output and
    # its log-sum-exp, and the w1 and w3 outputs
    if cfg is CFG:
        assert _planned(cfg, "full") == 256
        assert _planned(cfg, "selective") == 4 * (2 * 64 + 64 + 2 * 32 + 64 + 2 * 176) + 16
    # no recomputation keeps more than selective: eager PyTorch also keeps the norms' and RoPE's intermediates
    assert _kept_per_token_per_layer(cfg, "none") > _planned(cfg, "selective")


def test_recompute_changes_no_loss_or_gradient():
    x = torch.randint(0, CFG.vocab, (2, 33), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode in (
        "none",
        "selective",
        "per-op",
        "full",
    ):  # per-op: torchtitan's policy, for the planner's coming word
        model = apply_recompute(build_model(CFG, seed=0), mode)
        loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        grads[mode] = [loss.detach()] + [p.grad for p in model.parameters()]
        assert [n for n, _ in model.named_parameters()] == [
            n for n, _ in build_model(CFG).named_parameters()
        ]
    for mode in ("selective", "per-op", "full"):
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["none"])), mode
