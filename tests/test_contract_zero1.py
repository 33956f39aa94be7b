"""ZeRO 1's checkpoint holds the whole sharded optimizer state: on real gloo ranks (dp=2), each rank's own AdamW
state (step, exp_avg, exp_avg_sq of the parameters it owns) is equal, bit for bit, after a save and a resume, and
training continues as if never stopped: the losses and weights of two more steps are bit-identical."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from dist_util import run_ranks
from torch.distributed.tensor import DTensor

from fourd.ckpt.dcp_io import Checkpointer
from fourd.config import Config, set_value
from fourd.parallel.apply import build_parallel
from fourd.train.step import build_optimizer, train_step

pytestmark = pytest.mark.slow  # gloo ranks
SEQ, BATCH = 32, 4


def _build(rank, world, run_dir):
    cfg = Config()
    for key, value in {
        "model.preset": "debug",
        "model.layers": 2,
        "data.seq_len": SEQ,
        "train.global_batch": BATCH,
        "parallel.layout": "dp=2",
        "parallel.zero": 1,
        "run.dir": str(run_dir),
    }.items():
        set_value(cfg, key, value)
    torch.manual_seed(0)
    par = build_parallel(cfg, torch.device("cpu"), rank, world)
    opt = build_optimizer(par, cfg)
    ckpt = Checkpointer(cfg, par.stages, opt, layout="dp=2", contributes=rank == 0)
    return cfg, par, opt, ckpt


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A copy of this rank's part, as a plain tensor (ZeRO 1 replicates: the whole)."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _owned_state(par, opt) -> dict:
    """{parameter name: {step, exp_avg, exp_avg_sq}} of the parameters this rank owns, copied."""
    names = {p: n for s in par.stages for n, p in s.named_parameters()}
    return {
        names[p]: {k: _plain(v) for k, v in opt.state[p].items()} for p in opt.mine if opt.state[p]
    }


def _weights(par) -> dict:
    return {n: _plain(p) for s in par.stages for n, p in s.named_parameters()}


def _rank(rank, world, run_dir):
    tokens = torch.randint(0, 256, (4, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    rows = tokens[:, rank * 2 : rank * 2 + 2]

    def step(cfg, par, opt, i):
        x, y = rows[i, :, :-1], rows[i, :, 1:]
        return train_step(par, opt, x, y, cfg.train.lr, cfg, nullcontext)[0]

    cfg, par, opt, ckpt = _build(rank, world, run_dir)
    for i in range(2):
        step(cfg, par, opt, i)
    saved = _owned_state(par, opt)
    ckpt.save(2, 2 * BATCH)
    straight = [step(cfg, par, opt, i) for i in (2, 3)]
    straight_weights = _weights(par)

    cfg, par, opt, ckpt = _build(rank, world, run_dir)
    assert ckpt.resume() == (2, 2 * BATCH)
    loaded = _owned_state(par, opt)
    resumed = [step(cfg, par, opt, i) for i in (2, 3)]
    return saved, loaded, straight, resumed, straight_weights, _weights(par)


@pytest.mark.timeout(200)
def test_zero1_checkpoint_restores_every_ranks_optimizer_shard_exactly(tmp_path):
    results = run_ranks(_rank, 2, tmp_path, timeout=180)
    owners = [sorted(saved) for saved, *_ in results]
    assert owners[0] and owners[1] and not set(owners[0]) & set(owners[1])  # each rank owns a shard
    for rank, (saved, loaded, straight, resumed, want, got) in enumerate(results):
        assert loaded.keys() == saved.keys(), rank
        for name, state in saved.items():
            assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], (rank, name)
            assert float(state["step"]) == 2.0
            for key, value in state.items():
                assert torch.equal(loaded[name][key], value), (rank, name, key)
        assert resumed == straight, rank  # bit for bit
        assert all(torch.equal(got[n], want[n]) for n in want), rank
