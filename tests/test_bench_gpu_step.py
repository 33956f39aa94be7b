"""benchmarks/gpu_step.py runs end to end on any machine with --tiny: `fourd train` beside Hugging Face's Llama."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_step_tiny_runs_fourd_train_beside_hugging_face(tmp_path):
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/gpu_step.py",
        "--tiny",
        "--eager",
        "--steps",
        "4",
        "--json",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("| `") or line.startswith("| Hugging")
    ]
    assert (
        len(rows) == 2
        and "`fourd train`, eager" in rows[0]
        and "LlamaForCausalLM` (SDPA), eager" in rows[1]
    )
    got = json.loads(out.read_text())
    steps = got["step_time_s"]
    assert set(steps) == {"fourd eager", "hf eager"} and all(v > 0 for v in steps.values())
    assert got["tokens_per_s_ratios"] == {
        "fourd eager / hf eager": steps["hf eager"] / steps["fourd eager"]
    }
    assert (got["batch"], got["seq"]) == (2, 64)
