"""`fourd train` refuses, in one line and before it starts any worker, a run directory that already holds a
run (its metrics or its checkpoints) unless `--resume` is given (the contract's `fourd train` section)."""

import pytest
from conftest import run_fourd


@pytest.mark.parametrize("kept", ["metrics.jsonl", "checkpoints"])
def test_a_run_directory_holding_a_run_is_refused_without_resume(tmp_path, kept):
    run = tmp_path / "run"
    run.mkdir()
    if kept == "checkpoints":
        (run / kept).mkdir()
    else:
        (run / kept).write_text('{"step": 1, "loss": 5.0}\n')
    code, out, err = run_fourd(
        "train", "--model", "debug", "--steps", 1, "--run-dir", run, timeout=120
    )
    assert (code, out) == (2, "")
    assert err == (
        f"fourd: error: run directory {run} already holds a run: continue it with "
        f"`fourd train --resume {run}`, or choose another --run-dir (or leave it out for a fresh one)\n"
    )
    assert sorted(path.name for path in run.iterdir()) == [kept]  # nothing written beside it
