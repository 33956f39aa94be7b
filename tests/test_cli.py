"""The `fourd` command line itself: start-up time, no torch until a command needs it, --version, suggestions for
typos, and the words fourd prints (fourd.errors)."""

import statistics
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_fourd

from fourd import __version__
from fourd.cli import COMMANDS
from fourd.errors import did_you_mean, plural, si


def _seconds(*args) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "fourd", *args], cwd=ROOT, capture_output=True, check=True
    )
    return time.perf_counter() - t0


@pytest.mark.parametrize("args", [("--help",), ("plan", "--help")])
def test_help_takes_under_a_second(args):
    assert statistics.median(_seconds(*args) for _ in range(5)) < 1.0


def _no_torch(code: str):
    probe = f"import sys\n{code}\nassert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-600:]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_command_parser_imports_no_torch(name):
    _no_torch(f"from fourd.cli import build_parser\nbuild_parser({name!r})")


def test_help_plan_and_sim_faults_import_no_torch():
    _no_torch("from fourd.cli import build_parser\nbuild_parser(None).format_help()")
    _no_torch(
        "from fourd.cli import main\nassert main(['plan', '--model', 'llama3-8b', '--gpus', '8', '--json']) == 0"
    )
    _no_torch(
        "from fourd.cli import main\nassert main(['sim', 'faults', '--gpus', '64', '--days', '1', '--runs', '2']) == 0"
    )


def test_version_and_bare_commands():
    assert run_fourd("--version") == (0, f"fourd {__version__}\n", "")
    code, out, err = run_fourd()
    assert code == 0 and "train" in out and "sim" in out and err == ""
    code, out, err = run_fourd("sim")
    assert code == 0 and "step" in out and "faults" in out and err == ""


@pytest.mark.parametrize(
    "args,message",
    [
        (["trian"], "unknown command 'trian' (did you mean `train`?): `fourd --help` lists them"),
        (
            ["sim", "stpe"],
            "unknown command `fourd sim stpe` (did you mean `step`?): choose step, faults",
        ),
        (
            ["plan", "--modle", "x"],
            "unrecognised argument '--modle' (did you mean `--model`?) (see `fourd plan --help`)",
        ),
        (
            ["model", "info", "debgu"],
            "unknown model preset 'debgu': choose one of debug, small, llama3-8b, llama3-70b, llama3-405b",
        ),
    ],
)
def test_typos_get_one_line_and_a_suggestion(args, message):
    assert run_fourd(*args) == (2, "", f"fourd: error: {message}\n")


def test_words():
    assert did_you_mean("--modle", ["--model", "--layout"]) == " (did you mean `--model`?)"
    assert did_you_mean("zzz", ["--model"]) == ""
    assert [plural(1, "microbatch"), plural(4, "microbatch"), plural(1024, "rank")] == [
        "1 microbatch",
        "4 microbatches",
        "1,024 ranks",
    ]
    assert [si(218_496), si(6_031_616), si(8_030_261_248), si(405_853_388_800), si(950)] == [
        "218K",
        "6.03M",
        "8.03B",
        "406B",
        "950",
    ]
