"""The trainer's own path (build_parallel, build_optimizer, train_step) on real gloo ranks equals one process:
recomputation (selective, full) at tp=2,pp=2,dp=2 equals none within 1e-6, ZeRO 1 equals ZeRO 0 and one process
(and resumes from its checkpoints exactly), a pipeline of layers + 2 stages (embedding and output a stage each) and
compiled blocks under TP and PP equal one eager process within 1e-4, the tolerance of compiled blocks on one
process (inductor's fused kernels round differently from eager ones, and by how much depends on the CPU's vector
width: 1.1e-5 on an AVX-512 Xeon)."""

from contextlib import nullcontext

import pytest
import torch
from dist_util import run_ranks
from torch.distributed.tensor import DTensor

from fourd.config import Config, set_value
from fourd.parallel.apply import build_parallel, compiles
from fourd.parallel.cp import cp_shard
from fourd.train.step import build_optimizer, train_step

STEPS, SEQ, BATCH = 3, 32, 4
COMPILED_TOL = 1e-4  # compiled blocks against eager ones
BASE = {"model.preset": "debug", "data.seq_len": SEQ, "train.global_batch": BATCH, "train.lr": 3e-3}


def _config(**kw) -> Config:
    cfg = Config()
    for key, value in (BASE | {k.replace("__", "."): v for k, v in kw.items()}).items():
        set_value(cfg, key, value)
    return cfg


def trainer_run(rank, world, cfg):
    """STEPS steps of the trainer's step on one batch, on this rank: (losses, grad norms, this rank's full parameters)."""
    torch.manual_seed(0)
    par = build_parallel(cfg, torch.device("cpu"), rank, world)
    opt = build_optimizer(par, cfg)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    per, c, lay = BATCH // par.layout.dp, par.coords, par.layout
    losses, norms = [], []
    for _ in range(STEPS):
        rows = tokens[c["dp"] * per : (c["dp"] + 1) * per]
        x, y = (cp_shard(t, c["cp"], lay.cp) for t in (rows[:, :-1], rows[:, 1:]))
        loss, norm = train_step(par, opt, x, y, cfg.train.lr, cfg, nullcontext)
        losses.append(loss)
        norms.append(norm)
    full = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for s in par.stages
        for n, p in s.named_parameters()
    }
    return losses, norms, full


def _each(rank, world, configs):
    return {name: trainer_run(rank, world, cfg) for name, cfg in configs.items()}


def _assert_same(name, got, want, tol):
    (losses, norms, params), (r_losses, r_norms, r_params) = got, want
    for a, b in zip(losses + norms, r_losses + r_norms):
        assert abs(a - b) <= tol * abs(b), f"{name}: {losses}, {norms} vs {r_losses}, {r_norms}"
    for n, p in params.items():
        rel = ((p - r_params[n]).norm() / r_params[n].norm()).item()
        assert rel <= tol, f"{name} {n}: {rel:.2e}"


def _merged(per_rank, name):
    params = {}
    for results in per_rank:
        params.update(results[name][2])
    return params


FOUR_D = dict(
    parallel__layout="tp=2,pp=2,dp=2", parallel__microbatches=2, parallel__sequence_parallel=True
)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_recompute_and_zero1_at_tp2_pp2_dp2_equal_none_and_one_process():
    ref = trainer_run(0, 1, _config(parallel__microbatches=2))
    assert ref[0][-1] < ref[0][0], "the reference run must learn"
    configs = {
        mode: _config(**FOUR_D, parallel__recompute=mode, parallel__zero=2)
        for mode in ("none", "selective", "full")
    }
    configs["zero 1"] = _config(**FOUR_D, parallel__zero=1)
    per_rank = run_ranks(_each, 8, configs, timeout=380)
    for name in configs:
        assert _merged(per_rank, name).keys() == ref[2].keys(), name
        for rank, results in enumerate(per_rank):
            _assert_same(f"{name} rank {rank}", results[name], ref, 1e-5)
            if name in ("selective", "full"):
                _assert_same(
                    f"{name} rank {rank} against none", results[name], results["none"], 1e-6
                )


FOUR_RANKS = {
    "pp=4 over 2 layers": _config(
        parallel__layout="pp=4", parallel__microbatches=2, model__layers=2
    ),
    "dp=4 zero 0": _config(parallel__layout="dp=4", parallel__zero=0),
    "dp=4 zero 1": _config(parallel__layout="dp=4", parallel__zero=1),
    "tp=2,dp=2 zero 1 selective": _config(
        parallel__layout="tp=2,dp=2", parallel__zero=1, parallel__recompute="selective"
    ),
    "cp=2,dp=2 zero 1 selective": _config(
        parallel__layout="cp=2,dp=2", parallel__zero=1, parallel__recompute="selective"
    ),
    "tp=2,pp=2 compiled": _config(
        parallel__layout="tp=2,pp=2", parallel__microbatches=2, train__compile=True
    ),
    "cp=2,pp=2 zero 3 full": _config(
        parallel__layout="cp=2,pp=2",
        parallel__zero=3,
        parallel__recompute="full",
        parallel__microbatches=2,
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_layers_plus_two_stages_zero1_recompute_under_cp_and_compile_equal_one_process():
    refs = {
        "2 layers": trainer_run(0, 1, _config(model__layers=2)),
        "4 layers": trainer_run(0, 1, _config()),
    }
    per_rank = run_ranks(_each, 4, FOUR_RANKS, timeout=280)
    for name in FOUR_RANKS:
        ref = refs["2 layers" if "2 layers" in name else "4 layers"]
        assert _merged(per_rank, name).keys() == ref[2].keys(), name
        tol = COMPILED_TOL if "compiled" in name else 1e-5
        for rank, results in enumerate(per_rank):
            _assert_same(f"{name} rank {rank}", results[name], ref, tol)
    # the 4 stages: the embedding alone, one layer each, the norm and output projection alone
    assert [sorted(results["pp=4 over 2 layers"][2]) for results in per_rank] == [
        ["tok_embeddings.weight"],
        sorted(n for n in refs["2 layers"][2] if n.startswith("layers.0.")),
        sorted(n for n in refs["2 layers"][2] if n.startswith("layers.1.")),
        ["norm.weight", "output.weight"],
    ]
    for rank, results in enumerate(per_rank):
        _assert_same(
            f"zero 1 against zero 0, rank {rank}",
            results["dp=4 zero 1"],
            results["dp=4 zero 0"],
            1e-6,
        )


def _resume(rank, world, run_dir):
    """ZeRO 1 at dp=2: 3 steps straight, and 2 steps, a checkpoint, then a third step resumed at ZeRO 1 and 0."""
    from fourd.ckpt.dcp_io import Checkpointer

    def build(zero):
        cfg = _config(
            parallel__layout="dp=2", parallel__zero=zero, run__dir=str(run_dir), checkpoint__keep=2
        )
        par = build_parallel(cfg, torch.device("cpu"), rank, world)
        opt = build_optimizer(par, cfg)
        ckpt = Checkpointer(cfg, par.stages, opt, layout="dp=2", contributes=rank == 0)
        return cfg, par, opt, ckpt

    rows = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))[
        rank * 2 : rank * 2 + 2
    ]

    def step(cfg, par, opt):
        return train_step(par, opt, rows[:, :-1], rows[:, 1:], cfg.train.lr, cfg, nullcontext)[0]

    cfg, par, opt, _ = build(1)
    straight = [step(cfg, par, opt) for _ in range(3)]
    cfg, par, opt, ckpt = build(1)
    for _ in range(2):
        step(cfg, par, opt)
    ckpt.save(2, 2 * BATCH)
    resumed = {}
    for zero in (1, 0):
        cfg, par, opt, ckpt = build(zero)
        assert ckpt.resume() == (2, 2 * BATCH)
        resumed[zero] = step(cfg, par, opt)
    return straight, resumed


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_zero1_checkpoint_resumes_exactly_at_zero1_and_zero0(tmp_path):
    for straight, resumed in run_ranks(_resume, 2, tmp_path, timeout=180):
        assert straight[0] > straight[2]
        assert resumed[1] == straight[2]  # the same AdamW state, bit for bit
        assert abs(resumed[0] - straight[2]) <= 1e-6 * straight[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compiled_blocks_train_within_1e_4_of_eager_on_cpu():
    eager = trainer_run(0, 1, _config())
    compiled = trainer_run(0, 1, _config(train__compile=True))
    _assert_same("compiled", compiled, eager, COMPILED_TOL)


@pytest.mark.parametrize("asked", [True, False, None])
def test_train_compile_compiles_every_block_and_by_default_only_on_cuda(asked):
    """`--train.compile=true|false`: every block compiled in place (nn.Module.compile: its names unchanged), or
    none; unset, on CUDA only. Compiling is lazy: nothing is traced here, so this takes no time."""
    cfg = _config() if asked is None else _config(train__compile=asked)
    par = build_parallel(cfg, torch.device("cpu"), 0, 1)
    blocks = list(par.stages[0].layers.values())
    assert len(blocks) == 4
    assert [block._compiled_call_impl is not None for block in blocks] == [bool(asked)] * 4
    assert compiles(cfg, "cuda") == (asked is not False)
    assert compiles(cfg, "cpu") == bool(asked)
