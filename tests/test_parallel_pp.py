"""Pipeline parallelism on real gloo ranks: every schedule equals the single-process run."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_util import run_ranks

from fourd.errors import FourdError
from fourd.model.config import get_preset, with_overrides
from fourd.model.llama import build_model
from fourd.parallel.pp import PipelineRunner, layer_split, pipeline_split
from fourd.schedules import build_schedule

pytestmark = pytest.mark.slow  # gloo ranks

CFG = with_overrides(get_preset("debug"), layers=8)
SEQ, STEPS, LR = 16, 3, 1e-3
# Microbatch counts that are not multiples of pp; one sequence per microbatch.
MICROBATCHES = {2: 5, 4: 6}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1))


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _data(batch):
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CFG.vocab, (STEPS, batch, SEQ + 1), generator=gen)
    return tokens[..., :-1], tokens[..., 1:]


def _reference(batch):
    model = build_model(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for x, y in zip(*_data(batch)):
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pp_run(pp, group, name, v):
    m = MICROBATCHES[pp]
    schedule = build_schedule(name, pp, m, v)
    rank = dist.get_rank(group)
    stages = pipeline_split(CFG, rank, schedule, seed=0)
    runner = PipelineRunner(stages, schedule, group, _loss)
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=LR, foreach=False)
    xs, ys = _data(m)
    losses = []
    for x, y in zip(xs, ys):
        losses.append(runner.step(x, y).item())
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().clone() for s in stages for k, v in s.state_dict().items()}
    # The records of the last step name the schedule's actions in its order, one after another in the step.
    ran = [f"{r.kind}{r.stage}.{r.microbatch}" for r in runner.records]
    planned = [str(a) for a in schedule.ranks[rank]]
    times = [t for r in runner.records for t in (r.start, r.end)]
    in_order = times == sorted(times) and times[0] >= 0 and times[-1] <= runner.wall
    return {
        "case": (pp, name),
        "losses": losses,
        "params": params,
        "ran_as_planned": ran == planned and in_order,
        "bubble": runner.bubble_fraction,
        "busy": sum(r.end - r.start for r in runner.records),
        "wall": runner.wall,
    }


def _all_schedules(rank, world):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [
        _pp_run(pp, group, name, v)
        for pp, group in ((4, dist.group.WORLD), (2, pairs[rank // 2]))
        for name, v in SCHEDULES
    ]


@pytest.mark.timeout(240)
def test_every_schedule_at_pp2_and_pp4_equals_single_process():
    refs = {pp: _reference(m) for pp, m in MICROBATCHES.items()}
    results = run_ranks(_all_schedules, 4, timeout=230)
    for i, (pp, name) in enumerate((pp, name) for pp in (4, 2) for name, _ in SCHEDULES):
        ref_losses, ref_params = refs[pp]
        for group in [range(4)] if pp == 4 else [range(0, 2), range(2, 4)]:
            _check_group([results[r][i] for r in group], pp, name, ref_losses, ref_params)
    assert refs[4][0][-1] < refs[4][0][0]  # the runs really trained


def _check_group(runs, pp, name, ref_losses, ref_params):
    merged = {}
    for run in runs:
        assert run["case"] == (pp, name)
        assert run["losses"] == pytest.approx(ref_losses, rel=1e-5), (pp, name)
        assert run["ran_as_planned"], (pp, name)
        # the measured bubble is the idle share of the step's wall time, all of the rank's actions counted as busy
        assert 0.0 < run["bubble"] == 1 - run["busy"] / run["wall"] < 1.0
        assert not merged.keys() & run["params"].keys()  # no parameter lives on two ranks
        merged.update(run["params"])
    assert merged.keys() == ref_params.keys()
    for key, ref in ref_params.items():
        rel = ((merged[key] - ref).norm() / ref.norm()).item()
        assert rel < 1e-5, f"pp={pp} {name} {key}: relative difference {rel:.2e}"


def test_layer_split_llama3_405b_and_small_cases():
    assert layer_split(126, 16) == [7] + [8] * 14 + [7]
    assert sum(layer_split(126, 16)) == 126
    assert layer_split(128, 16, fewer_first_last=False) == [8] * 16
    assert layer_split(8, 2) == [4, 4]
    assert layer_split(128, 16) == [8] * 16  # the two leftover layers fill the first and last stage
    assert layer_split(127, 16) == [8] + [8] * 14 + [7]
    assert layer_split(8, 4) == [2, 2, 2, 2]
    assert layer_split(32, 4) == [8, 8, 8, 8]
    assert layer_split(30, 4) == [7, 8, 8, 7]
    assert layer_split(8, 8) == [1] * 8  # one layer fewer would leave an edge stage empty
    assert layer_split(10, 4, fewer_first_last=False) == [2, 3, 3, 2]
    assert layer_split(126, 128, empty_edges=True) == [0] + [1] * 126 + [0]
    assert layer_split(5, 1) == [5]
    with pytest.raises(FourdError, match=r"3 layers cannot fill 4 pipeline stages"):
        layer_split(3, 4)


def test_pipeline_split_places_layers_by_loop_and_keeps_names():
    schedule = build_schedule("interleaved", pp=2, microbatches=4, virtual_stages=2)
    model = build_model(CFG, seed=0)
    stages = pipeline_split(model, 1, schedule)  # stages 1 and 3 of [2, 2, 2, 2] layers
    assert [list(s.layers) for s in stages] == [["2", "3"], ["6", "7"]]
    assert stages[0].tok_embeddings is None and stages[0].output is None
    assert stages[1].output is model.output and stages[1].norm is model.norm
    assert stages[0].layers["2"] is model.layers["2"]
    built = pipeline_split(CFG, 1, schedule, seed=0)
    for a, b in zip(stages, built):
        assert a.state_dict().keys() == b.state_dict().keys()
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), k
