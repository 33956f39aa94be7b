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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `make test`'s two xdist workers (--dist loadgroup): a module whose tests share a module-scoped
    fixture runs on one worker, so the fixture is built once (unless the module sets SPREAD = True: its fixture is
    cheap beside its many tests); every other test goes wherever a worker is free. First of the hooks: xdist's
    own, on each worker, names a test's group from this marker (and needs pytest below 9.2 to do so)."""
    for item in items:
        shared = [
            d
            for defs in item._fixtureinfo.name2fixturedefs.values()
            for d in defs
            if d.scope != "function" and getattr(d.func, "__module__", "") == item.module.__name__
        ]
        if shared and not getattr(item.module, "SPREAD", False):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # the modules with multi-process (slow) tests first, each module's tests together and in order: the
    # workers hand out work in this order, so the last minutes are filled with quick tests instead of
    # one worker finishing a long training run while the other waits
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)
