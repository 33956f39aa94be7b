"""`fourd ckpt info` and `fourd ckpt verify`: exact output, the skipped damaged checkpoint, no torch."""

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from fourd.ckpt import store
from fourd.cli import main
from fourd.model.config import get_preset
from fourd.model.llama import build_model

CFG = get_preset("debug")


def digest_by_hand(sd: dict) -> str:
    """The documented digest: per tensor in name order, name NUL dtype NUL shape NUL, then the raw bytes."""
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].contiguous()
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    sd = build_model(CFG, seed=3).state_dict()
    for step in (4, 8):
        train = {
            "step": step,
            "samples": 16 * step,
            "seed": 0,
            "data": {"path": "c.jsonl", "tokens": 5000},
        }
        store.save_model_checkpoint(
            run / "checkpoints" / f"step-{step}",
            CFG,
            sd,
            step=step,
            layout="tp=2,pp=2",
            extra={"train": train},
        )
    return run, digest_by_hand(sd)


def test_info_text_and_json(run, capsys):
    run, digest = run
    ck = run / "checkpoints" / "step-8"
    files = sorted(p for p in ck.iterdir() if p.name != "manifest.json")
    size = sum(p.stat().st_size for p in files)
    assert main(["ckpt", "info", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"path           {ck}",
        "step           8",
        "layout         tp=2,pp=2",
        "model          4 layers, dim 64, heads 4/2, vocab 256",
        f"model_digest   {digest}",
        f"files          2 ({size:,} bytes)",
        "train          samples 128, seed 0, step 8",
        "data           path c.jsonl, tokens 5000",
    ]
    assert main(["ckpt", "info", str(ck), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["step"], info["layout"], info["model_digest"]) == (8, "tp=2,pp=2", digest)
    assert (info["path"], info["files"], info["bytes"], info["model"]) == (
        str(ck),
        2,
        size,
        CFG.to_dict(),
    )
    assert info["train"] == {
        "step": 8,
        "samples": 128,
        "seed": 0,
        "data": {"path": "c.jsonl", "tokens": 5000},
    }


def test_verify_names_the_checkpoint_and_its_digest(run, capsys):
    run, digest = run
    ck = run / "checkpoints" / "step-4"
    size = sum(p.stat().st_size for p in ck.iterdir() if p.name != "manifest.json")
    assert main(["ckpt", "verify", str(ck)]) == 0
    assert (
        capsys.readouterr().out
        == f"{ck}: OK, step 4, 2 files, {size:,} bytes, model_digest {digest}\n"
    )


def test_info_and_verify_say_when_they_skip_a_damaged_newer_checkpoint(run, tmp_path, capsys):
    import shutil

    shutil.copytree(run[0], tmp_path / "run")
    (tmp_path / "run" / "checkpoints" / "step-8" / "manifest.json").write_text('{"step": 8')  # torn
    warning = "fourd: warning: falling back to the previous complete checkpoint step-4 (skipped damaged step-8)\n"
    for argv in (
        ["ckpt", "info", str(tmp_path / "run"), "--json"],
        ["ckpt", "verify", str(tmp_path / "run")],
    ):
        assert main(argv) == 0
        captured = capsys.readouterr()
        assert captured.err == warning and "step-4" in captured.out


def test_info_loads_no_torch(run):
    code = (
        "import sys\nfrom fourd.cli import main\n"
        f"assert main(['ckpt', 'info', {str(run[0])!r}]) == 0\nprint(sorted(m for m in sys.modules if m == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "[]", out.stderr
