"""`fourd train` at several layouts from the command line: the same losses as one process."""

import json

import pytest


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl") if line.strip()]


def rel(a, b):
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


COMMON = (
    "--model",
    "debug",
    "--steps",
    3,
    "--seed",
    0,
    "--data.seq_len=64",
    "--train.global_batch=8",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import run_fourd

    d = tmp_path_factory.mktemp("ref")
    code, _, err = run_fourd("train", *COMMON, "--run-dir", d)
    assert code == 0, err
    return losses(d)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "layout,extra",
    [("tp=2,dp=2", ()), ("tp=2,cp=2,pp=2,dp=2", ("--schedule", "1f1b", "--microbatches", 4))],
)
def test_layout_losses_equal_one_process(fourd, tmp_path, reference, layout, extra):
    code, _, err = fourd(
        "train", *COMMON, "--layout", layout, *extra, "--run-dir", tmp_path, timeout=380
    )
    assert code == 0, err[-2000:]
    assert rel(losses(tmp_path), reference) < 1e-5
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    if "pp=2" in layout:
        assert all(0 < r["bubble_fraction"] < 1 for r in rows)
        # the last step's pipeline actions of every rank: 4 forwards and 4 backwards each (1F1B, M = 4)
        events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
        names = [e for e in events if e["ph"] == "M"]
        actions = [e for e in events if e["ph"] == "X"]
        assert len(names) == 16 and len(actions) == 16 * 8
        mine = [e for e in actions if e["pid"] == 0]
        assert sorted(e["name"] for e in mine) == sorted(
            [f"F0.{m}" for m in range(4)] + [f"B0.{m}" for m in range(4)]
        )
        # rank 0 logs its own last step: idle at least the gaps before its last action ends (the step lasts longer)
        busy, last_end = sum(e["dur"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
        assert rows[-1]["bubble_fraction"] >= 1 - busy / last_end - 1e-9


REFUSED = [
    (
        ("--layout", "tp=3"),
        "tp=3 cannot cut the model's heads (4), KV heads (2), FFN width (176) and vocabulary (256) into equal parts: choose tp among 1, 2",
    ),
    (
        ("--layout", "pp=8"),
        "pp=8 with 1 virtual stage makes 8 pipeline stages for 4 layers: use at most 4 stages, or exactly 6 (the embedding and the output a stage each)",
    ),
    (
        ("--layout", "cp=3"),
        "sequence length 256 is not a multiple of 2·cp = 6 (context parallelism cuts each sequence into 2·cp chunks): choose a multiple of 6, or a smaller cp",
    ),
    (
        ("--layout", "dp=3"),
        "the global batch of 16 sequences does not split into dp × microbatches = 3 × 1 equal parts: choose a global batch that is a multiple of 3",
    ),
    (
        ("--layout", "pp=2", "--microbatches", 3),
        "the global batch of 16 sequences does not split into dp × microbatches = 1 × 3 equal parts: choose a global batch that is a multiple of 3",
    ),
    (
        ("--layout", "tp=2,zz=2"),
        "layout 'tp=2,zz=2': bad item 'zz=2'; write key=value with keys tp, cp, pp, dp",
    ),
    (("--layout", "tp=0"), "layout tp=0: each degree must be a positive integer, e.g. tp=2"),
]


@pytest.mark.parametrize("args,message", REFUSED)
def test_impossible_layouts_are_refused_before_launch(fourd, tmp_path, args, message):
    code, out, err = fourd(
        "train", "--model", "debug", "--steps", 1, "--run-dir", tmp_path / "run", *args
    )
    assert (code, err) == (2, f"fourd: error: {message}\n")
    assert not (tmp_path / "run").exists()
