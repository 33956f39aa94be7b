"""The 4D mesh on 8 real gloo ranks follows fourd.layout's rank formula (order [TP, CP, PP, DP], Llama 3 paper
§3.3.2), and the gradient norm is the true global norm when gradients are cut by TP (with sequence parallelism),
sharded by FSDP and split over pipeline stages."""

import pytest
import torch
from dist_util import run_ranks
from torch.distributed.tensor import DTensor

from fourd.errors import FourdError
from fourd.layout import Layout
from fourd.model.config import get_preset
from fourd.model.llama import build_model
from fourd.parallel.dp import apply_dp
from fourd.parallel.grad import clip_grad_norm
from fourd.parallel.mesh import build_mesh, dp_cp_mesh
from fourd.parallel.tp import apply_tp, loss_fn

pytestmark = pytest.mark.slow  # gloo ranks

CFG = get_preset("debug")
BATCH, SEQ, MAX_NORM = 4, 16, 0.01
LAYOUTS = [Layout(tp=2, cp=2, pp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=4, dp=2)]


def _describe(mesh):
    return {
        "names": mesh.mesh_dim_names,
        "coordinate": mesh.get_coordinate(),
        "groups": {name: mesh[name].mesh.flatten().tolist() for name in mesh.mesh_dim_names},
        "dp_cp": dp_cp_mesh(mesh).mesh.tolist(),
    }


def _stage(pp_rank):
    """Pipeline stage pp_rank of 2: layers 0-1 with the embedding, or layers 2-3 with the norm and output."""
    model = build_model(CFG, seed=0)
    keep = ("0", "1") if pp_rank == 0 else ("2", "3")
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if pp_rank == 0:
        model.norm, model.output = None, None
    else:
        model.tok_embeddings = None
    return model


def _data():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG.vocab, (BATCH, SEQ), generator=g)
    hidden = torch.randn(BATCH, SEQ, CFG.dim, generator=g)
    targets = torch.randint(0, CFG.vocab, (BATCH, SEQ), generator=g)
    return tokens, hidden, targets


def _stage_loss(model, pp_rank, rows, tp=1, tp_rank=0):
    """Each stage's own loss on its batch rows: the mean of h² out of stage 0, the cross-entropy of stage 1.
    Under sequence parallelism a stage passes and takes this TP rank's sequence shard."""
    tokens, hidden, targets = (t[rows] for t in _data())
    cut = slice(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)
    if pp_rank == 0:
        h = model(tokens)
        return h.pow(2).sum() / (len(tokens) * SEQ * CFG.dim)  # this shard's part of the mean
    return loss_fn(model(hidden[:, cut]), targets)


def _eight_ranks(rank, world):
    meshes = [_describe(build_mesh(lay)) for lay in LAYOUTS]
    meshes.append(_describe(build_mesh(Layout(tp=2, dp=4), hsdp_replicate=2)))
    # The gradient norm on tp=2 (sequence parallel), pp=2, dp=2 (zero3).
    lay = LAYOUTS[1]
    mesh = build_mesh(lay)
    c = lay.coords(rank)
    model = _stage(c["pp"])
    apply_tp(model, mesh["tp"], sequence_parallel=True)
    apply_dp(model, dp_cp_mesh(mesh), 3)
    rows = slice(c["dp"] * BATCH // 2, (c["dp"] + 1) * BATCH // 2)
    _stage_loss(model, c["pp"], rows, tp=2, tp_rank=c["tp"]).backward()
    norm = clip_grad_norm(model.parameters(), MAX_NORM, mesh)
    grads = {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for n, p in model.named_parameters()
    }
    refusals = []
    hsdp = build_mesh(Layout(tp=2, dp=4), hsdp_replicate=2)
    for dp_mesh, zero in ((dp_cp_mesh(hsdp), 2), (dp_cp_mesh(mesh), 4)):
        try:
            apply_dp(build_model(CFG, seed=0), dp_mesh, zero)
        except FourdError as e:
            refusals.append(str(e))
    return meshes, norm, grads, refusals


@pytest.mark.timeout(180)
def test_mesh_ranks_and_global_grad_norm():
    ref_grads, sq = {}, 0.0
    for pp_rank in (0, 1):
        model = _stage(pp_rank)
        _stage_loss(model, pp_rank, slice(None)).backward()
        for n, p in model.named_parameters():
            ref_grads[n] = p.grad
            sq += p.grad.pow(2).sum().item()
    ref_norm = sq**0.5
    assert ref_norm > 10 * MAX_NORM  # clipping is active

    results = run_ranks(_eight_ranks, 8, timeout=170)

    for rank, (meshes, norm, grads, refusals) in enumerate(results):
        assert refusals == [
            "a 2-D (HSDP) data-parallel mesh takes ZeRO stage 3, not 2: build a 1-D mesh",
            "ZeRO stage 4: choose one of 0, 1, 2, 3",
        ]
        for lay, got in zip(LAYOUTS, meshes):
            c = lay.coords(rank)
            assert got["names"] == ("dp", "pp", "cp", "tp")
            assert got["coordinate"] == (c["dp"], c["pp"], c["cp"], c["tp"])
            for dim in ("tp", "cp", "pp", "dp"):
                members = [lay.rank(**(c | {dim: i})) for i in range(getattr(lay, dim))]
                assert got["groups"][dim] == members, f"{lay} rank {rank} {dim}"
            assert got["dp_cp"] == [
                lay.rank(**(c | {"dp": d, "cp": k})) for d in range(lay.dp) for k in range(lay.cp)
            ]
        hsdp = meshes[-1]
        assert hsdp["names"] == ("dp_replicate", "dp_shard", "pp", "cp", "tp")
        # rank = tp + 2·dp, dp = 2·replicate + shard: the shard groups are the nearer ranks.
        assert hsdp["groups"]["dp_shard"] == [
            rank % 2 + 4 * (rank // 4),
            rank % 2 + 4 * (rank // 4) + 2,
        ]
        assert hsdp["dp_cp"] == [[rank % 2 + 4 * r + 2 * s for s in range(2)] for r in range(2)]

        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, f"rank {rank}: norm {norm} vs {ref_norm}"
        scale = MAX_NORM / (ref_norm + 1e-6)
        for n, g in grads.items():
            rel = ((g - ref_grads[n] * scale).norm() / (ref_grads[n] * scale).norm()).item()
            assert rel <= 1e-5, f"rank {rank} {n}: clipped gradient off by {rel:.2e}"
        assert len(grads) == (19 if LAYOUTS[1].coords(rank)["pp"] == 0 else 20)
