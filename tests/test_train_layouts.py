"""`fourd train` at several layouts from the command line: the same losses as one process."""

import json

import pytest


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl") if line.strip()]


def rel(a, b):
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


COMMON = ("--model", "debug", "--steps", 3, "--seed", 0, "--data.seq_len=64", "--train.global_batch=8")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from conftest import run_fourd

    d = tmp_path_factory.mktemp("ref")
    code, _, err = run_fourd("train", *COMMON, "--run-dir", d)
    assert code == 0, err
    return losses(d)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "layout,extra", [("tp=2,dp=2", ()), ("tp=2,cp=2,pp=2,dp=2", ("--schedule", "1f1b", "--microbatches", 4))]
)
def test_layout_losses_equal_one_process(fourd, tmp_path, reference, layout, extra):
    code, _, err = fourd("train", *COMMON, "--layout", layout, *extra, "--run-dir", tmp_path, timeout=380)
    assert code == 0, err[-2000:]
    assert rel(losses(tmp_path), reference) < 1e-5
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    if "pp=2" in layout:
        assert all(0 <= r["bubble_fraction"] < 1 for r in rows)
        # the last step's pipeline actions of every rank: 4 forwards and 4 backwards each (1F1B, M = 4)
        events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
        names = [e for e in events if e["ph"] == "M"]
        actions = [e for e in events if e["ph"] == "X"]
        assert len(names) == 16 and len(actions) == 16 * 8
        assert sorted(e["name"] for e in actions if e["pid"] == 0) == sorted(
            [f"F0.{m}" for m in range(4)] + [f"B0.{m}" for m in range(4)]
        )


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--layout", "tp=3"), "tp"),
        (("--layout", "pp=8"), "4 layers"),
        (("--layout", "cp=3"), "2·cp = 6"),
        (("--layout", "dp=3"), "global batch"),
        (("--layout", "pp=2", "--microbatches", 3), "microbatch"),
        (("--layout", "tp=2,zz=2"), "zz"),
        (("--layout", "tp=0"), "tp"),
    ],
)
def test_impossible_layouts_are_refused_before_launch(fourd, tmp_path, args, needle):
    code, out, err = fourd("train", "--model", "debug", "--steps", 1, "--run-dir", tmp_path, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()
