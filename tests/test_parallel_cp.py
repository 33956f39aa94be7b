"""Context parallelism on real gloo ranks equals the single-process run, and moves the K/V it should."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_util import run_ranks

from fourd.errors import FourdError
from fourd.model.config import get_preset
from fourd.model.llama import build_model
from fourd.parallel.cp import apply_cp, cp_positions, cp_shard

pytestmark = pytest.mark.slow  # gloo ranks

CFG = get_preset("debug")  # 4 layers, 4 heads over 2 KV heads (GQA), head_dim 16
BATCH, SEQ, STEPS, LR = 2, 32, 5, 1e-3


def cp_unshard(tensor, group, dim=1):
    """The full sequence from every cp rank's shard, in true order: the inverse of cp_shard."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(cp)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    order = torch.cat([cp_positions(tensor.shape[dim] * cp, r, cp) for r in range(cp)])
    return torch.cat(parts, dim=dim).index_select(dim, order.argsort())


def _data():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CFG.vocab, (STEPS, BATCH, SEQ + 1), generator=gen)
    return tokens[..., :-1], tokens[..., 1:]


def _train(model, xs, ys, grad_sync=None):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for x, y in zip(xs, ys):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(grad_sync(model, loss) if grad_sync else loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cp_run(rank, cp, group):
    xs, ys = _data()
    model = apply_cp(build_model(CFG, seed=0), group, SEQ)
    r = dist.get_rank(group)

    def average_over_cp(model, loss):
        # Every cp rank sees the same number of tokens, so the mean of rank means is the global mean.
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= cp
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total.item() / cp

    # Forward only first: the full logits, gathered back into true order, match the unsharded model.
    with torch.no_grad():
        logits = cp_unshard(model(cp_shard(xs[0], r, cp)), group)
    traffic = [layer.attention.core.gathered_elements for layer in model.layers.values()]
    losses, params = _train(
        model, cp_shard(xs, r, cp, dim=2), cp_shard(ys, r, cp, dim=2), average_over_cp
    )
    return {"cp": cp, "logits": logits, "traffic": traffic, "losses": losses, "params": params}


def _cp2_and_cp4(rank, world):
    out = [_cp_run(rank, 4, dist.group.WORLD)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out.append(_cp_run(rank, 2, pairs[rank // 2]))
    return out


@pytest.mark.timeout(180)
def test_cp2_and_cp4_equal_single_process():
    xs, ys = _data()
    ref_model = build_model(CFG, seed=0)
    with torch.no_grad():
        ref_logits = ref_model(xs[0])
    ref_losses, ref_params = _train(ref_model, xs, ys)

    results = run_ranks(_cp2_and_cp4, 4, timeout=170)
    for per_rank in results:
        for run in per_rank:
            cp = run["cp"]
            torch.testing.assert_close(run["logits"], ref_logits, rtol=1e-5, atol=1e-6)
            assert run["losses"] == pytest.approx(ref_losses, rel=1e-5)
            for name, ref in ref_params.items():
                # Relative to the tensor's norm: Adam divides by √v, so single elements whose gradient
                # is ~0 may differ in the last bits of the reduction order.
                rel = ((run["params"][name] - ref).norm() / ref.norm()).item()
                assert rel < 1e-5, f"cp={cp} {name}: relative difference {rel:.2e}"
            # All-gathered elements per layer per rank = (CP−1)/CP · 2·s·b·h_kv, for each of the
            # 1 + STEPS forward passes.
            h_kv = CFG.kv_heads * CFG.head_dim
            per_forward = (cp - 1) * 2 * SEQ * BATCH * h_kv // cp
            assert run["traffic"] == [per_forward] * CFG.layers
    assert ref_losses[-1] < ref_losses[0]  # the runs really trained


def test_each_rank_holds_chunks_i_and_mirror():
    assert cp_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(8, 3, 4).tolist() == [3, 4]
    x = torch.arange(24).view(1, 24)
    assert cp_shard(x, 1, 3).tolist() == [[4, 5, 6, 7, 16, 17, 18, 19]]
    assert cp_shard(x, 0, 1) is x


def test_sequence_not_divisible_by_two_cp_is_refused():
    with pytest.raises(FourdError, match=r"sequence length 30 must be a multiple of 2·cp = 8"):
        cp_positions(30, 0, 4)
