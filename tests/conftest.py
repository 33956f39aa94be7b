import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_fourd(*args, env=None, timeout=300, cwd=None):
    """`fourd ARGS` in a fresh process: (exit code, stdout, stderr)."""
    # PYTHONPATH: this checkout's fourd, whatever the working directory
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    if env:
        e.update(env)
    p = subprocess.run(
        [sys.executable, "-m", "fourd", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        cwd=cwd or ROOT,
    )
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def fourd():
    return run_fourd
