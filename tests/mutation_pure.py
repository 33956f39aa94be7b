"""`make mutation-pure`: cosmic-ray's mutants of fourd's pure-Python modules, each module against its own fast tests.

    python tests/mutation_pure.py [MODULE ...]     # default: every module of MODULES, in order
    python tests/mutation_pure.py --report         # the table of what the sessions hold so far
    python tests/mutation_pure.py --recheck MODULE # its survivors against its tests as they are now

Each module runs in its own copy of the repository (cosmic-ray rewrites the file it mutates in place) under
.mutation/, with its session (an SQLite file) kept there: a second run does only the mutants not yet tried,
and a module whose source or tests changed starts a fresh session. A mutant is killed when its tests fail,
or when they run past the time-out (10 × the unmutated run, at least 20 s; counted apart). Not part of
`make test`: a module takes minutes to an hour on a two-core machine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".mutation"
# what the tests read besides the package: benchmarks/ holds the validation suite whose pinned figures the
# planner's tests check (without it they skip, and a mutant of the model survives them)
COPIED = ("fourd", "tests", "configs", "benchmarks", "pyproject.toml")
COSMIC_RAY = str(Path(sys.executable).parent / "cosmic-ray")  # the environment's, beside its python
# the copy's fourd first on the path, not the one installed in the environment
PYTEST = (
    "env PYTHONPATH={work} OMP_NUM_THREADS=1 "
    + sys.executable
    + " -m pytest -x -q -p no:cacheprovider"
)
PYTEST += " -m 'not slow and not mutation'"

# the planner's fast tests, the suite's pinned figures first: most mutants of the step-time model move them
PLANNER_TESTS = (
    "tests/test_plan_validation.py",
    "tests/test_plan_first_predictions.py",
    "tests/test_plan_model.py",
    "tests/test_plan_arith.py",
    "tests/test_contract_kernels.py",
    "tests/test_contract_perf.py",
    "tests/test_plan_stack.py",
)
# module: the fast tests that pin it (single-process, seconds)
MODULES: dict[str, tuple[str, ...]] = {
    "fourd/schedules.py": ("tests/test_schedules.py", "tests/test_lab_api.py"),
    "fourd/layout.py": ("tests/test_parallel_layout.py", "tests/test_contract_limits.py"),
    # test_train_loop.py's refusals run `fourd train` (slow, deselected); its one fast test is lr_at's, and
    # collecting it imports torch (5 s a mutant): test_contract_config.py reads the same refusals in-process
    "fourd/config.py": ("tests/test_contract_limits.py", "tests/test_contract_config.py"),
    "fourd/comm/__init__.py": ("tests/test_contract_bus.py",),
    "fourd/sim/faults.py": ("tests/test_sim_faults.py", "tests/test_contract_faults.py"),
    # the contract tests first: they run in a second, and -x stops at the first failure
    "fourd/sim/step.py": (
        "tests/test_contract_sim_step.py",
        "tests/test_sim_step.py",
        "tests/test_sim_pipeline.py",
    ),
    "fourd/sim/network.py": ("tests/test_sim_step.py", "tests/test_contract_network.py"),
    "fourd/plan/memory.py": (
        "tests/test_plan_arith.py",
        "tests/test_contract_limits.py",
        "tests/test_contract_memory.py",
    ),
    "fourd/plan/stack.py": ("tests/test_plan_stack.py", "tests/test_contract_kernels.py"),
    # the suite's pinned figures move with any GEMM, attention or collective time
    "fourd/plan/kernels.py": (*PLANNER_TESTS, "tests/test_contract_bus.py"),
    "fourd/data/dataset.py": ("tests/test_data_stream.py", "tests/test_data_mix.py"),
    "fourd/plan/perf.py": PLANNER_TESTS,
    # and the block measured: its forward bytes and kept tensors (imports torch: about 3 s a mutant)
    "fourd/plan/block.py": (*PLANNER_TESTS, "tests/test_contract_block.py"),
    # a planned run: its switches as the stack or the flags set them, its microbatch, its work
    "fourd/plan/job.py": (*PLANNER_TESTS, "tests/test_contract_job.py"),
    # the suite's anchored series, intervals and coverage are pinned beside the model's own figures
    "fourd/plan/intervals.py": (
        "tests/test_contract_intervals.py",
        "tests/test_plan_intervals.py",
        "tests/test_plan_validation.py",
    ),
    "fourd/plan/anchor.py": (
        "tests/test_contract_anchor.py",
        "tests/test_plan_anchor.py",
        "tests/test_plan_validation.py",
    ),
    # the text report: its tables, its verdicts and its reasons
    "fourd/plan/report.py": (
        "tests/test_plan_report.py",
        "tests/test_plan_model.py",
        "tests/test_plan_cli.py",
    ),
    # the request: flags and values parsed, checked and defaulted before any search
    "fourd/plan/request.py": (
        "tests/test_plan_request_values.py",
        "tests/test_plan_request.py",
        "tests/test_plan_cli.py",
        "tests/test_contract_limits.py",
        "tests/test_cli_bad_input.py",
        "tests/test_plan_model.py",
        "tests/test_plan_validation.py",
    ),
    # the cluster's profile and where each group of ranks sits in it
    "fourd/plan/cluster.py": (
        "tests/test_contract_cluster.py",
        *PLANNER_TESTS,
        "tests/test_plan_request.py",
        "tests/test_plan_cli.py",
        "tests/test_contract_limits.py",
    ),
    # the search: candidates, their order, the best that fits
    # (test_contract_recompute.py's hardware FLOPs are test_contract_search.py's too, without its
    # torch import: 5 s a mutant)
    "fourd/plan/search.py": (
        "tests/test_contract_search.py",
        *PLANNER_TESTS,
        "tests/test_plan_cli.py",
    ),
    # the corpora a dataset is prepared from: kinds, readers, fields, refusals
    "fourd/data/sources.py": (
        "tests/test_data_prepare.py",
        "tests/test_data_stream.py",
        "tests/test_data_mix.py",
    ),
    # the byte, Hugging Face and tiktoken tokenizers and the BPE ranks file
    "fourd/data/tokenizer.py": (
        "tests/test_data_tokenizer.py",
        "tests/test_data_prepare.py",
        "tests/test_data_stream.py",
    ),
    # the lab's figures: the planner's and the simulators' answers as the page shows them
    "fourd/lab/api.py": ("tests/test_lab_api.py",),
    # the model's shapes, parameter counts and MFU's FLOPs, which the planner and the trainer share
    "fourd/model/config.py": (
        "tests/test_model_config.py",
        "tests/test_contract_arith.py",
        "tests/test_model_llama.py",
        "tests/test_contract_block.py",
    ),
}
# tests in those files that pin another module, left out of the module's runs: hypothesis's 150 corpora of
# fourd.data.sources take 2.5 s of test_data_stream.py's 4
DESELECT: dict[str, tuple[str, ...]] = {
    "fourd/data/dataset.py": (
        "tests/test_data_stream.py::test_any_jsonl_ends_in_documents_or_one_line",
    ),
}


def _digest(module: str) -> str:
    """The module's source and its tests: a change to either starts its session afresh."""
    sha = hashlib.sha256()
    for path in (module, *MODULES[module]):
        sha.update((ROOT / path).read_bytes())
    sha.update(repr(DESELECT.get(module, ())).encode())
    sha.update(repr(COPIED).encode())
    return sha.hexdigest()[:16]


def _name(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def _copy(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(ROOT / name, work / name)


def _run(module: str) -> None:
    name, tests = _name(module), " ".join(MODULES[module])
    tests += "".join(f" --deselect {test}" for test in DESELECT.get(module, ()))
    work, session = CACHE / "work" / name, CACHE / f"{name}.sqlite"
    stamp, command = CACHE / f"{name}.digest", f"{PYTEST.format(work=work)} {tests}"
    _copy(work)
    started = time.perf_counter()
    control = subprocess.run(f"{command} -rs", shell=True, cwd=work, capture_output=True)
    if control.returncode != 0:
        raise SystemExit(f"{module}: its tests fail unmutated:\n{control.stdout.decode()[-2000:]}")
    skipped = [line for line in control.stdout.decode().splitlines() if line.startswith("SKIPPED")]
    if skipped:  # a test that skips in the copy kills no mutant
        raise SystemExit(
            f"{module}: {len(skipped)} of its tests skip in the copy ({skipped[0]}): add what they "
            "read to COPIED in tests/mutation_pure.py"
        )
    timeout = max(20.0, 10 * (time.perf_counter() - started))
    config = work / "cosmic-ray.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{module}"\n'
        f"timeout = {timeout:.0f}\n"
        "excluded-modules = []\n"
        f'test-command = "{command}"\n'
        '[cosmic-ray.distributor]\nname = "local"\n'
    )
    fresh = not session.exists() or not stamp.exists() or stamp.read_text() != _digest(module)
    if fresh:
        session.unlink(missing_ok=True)
        subprocess.run([COSMIC_RAY, "init", str(config), str(session)], cwd=work, check=True)
        stamp.write_text(_digest(module))
    subprocess.run([COSMIC_RAY, "exec", str(config), str(session)], cwd=work, check=True)


def counts(module: str) -> dict[str, int] | None:
    """Mutants, killed, survived, timed out (and not yet run) of a module's session; None without one."""
    session = CACHE / f"{_name(module)}.sqlite"
    if not session.exists():
        return None
    dump = subprocess.run(
        [COSMIC_RAY, "dump", str(session)], capture_output=True, text=True, check=True
    )
    out = dict.fromkeys(("mutants", "killed", "survived", "timed out", "pending"), 0)
    for line in filter(None, dump.stdout.splitlines()):
        _item, result = json.loads(line)
        out["mutants"] += 1
        if result is None:
            out["pending"] += 1
        elif result["test_outcome"] == "survived":
            out["survived"] += 1
        elif result.get("output") == "timeout":
            out["timed out"] += 1
        else:
            out["killed"] += 1
    return out


def survivors(module: str) -> list[str]:
    """The diff of each surviving mutant."""
    session = CACHE / f"{_name(module)}.sqlite"
    dump = subprocess.run(
        [COSMIC_RAY, "dump", str(session)], capture_output=True, text=True, check=True
    )
    found = []
    for line in filter(None, dump.stdout.splitlines()):
        _item, result = json.loads(line)
        if result is not None and result["test_outcome"] == "survived":
            found.append(result["diff"])
    return found


def report() -> str:
    rows = ["| module | mutants | killed | survived | timed out | not run | killed % |"]
    rows.append("|---|---:|---:|---:|---:|---:|---:|")
    for module in MODULES:
        c = counts(module)
        if c is None:
            continue
        done = c["mutants"] - c["pending"]
        share = f"{100 * (c['killed'] + c['timed out']) / done:.1f}" if done else "-"
        rows.append(
            f"| `{module}` | {c['mutants']} | {c['killed']} | {c['survived']} | {c['timed out']} | "
            f"{c['pending']} | {share} |"
        )
    return "\n".join(rows)


def recheck(module: str) -> tuple[list[str], list[str]]:
    """Each surviving mutant of the module's session applied (its diff, with `patch`) to a fresh copy
    of the current tree and run against the module's current tests: (the diffs of those that still
    pass, the diffs that no longer apply to the module as it is now). A session runs against the
    tests of its start; this says which survivors the tests added since kill."""
    work = CACHE / "work" / f"{_name(module)}.recheck"
    _copy(work)
    pristine = (work / module).read_text()
    tests = " ".join(MODULES[module])
    command = f"{PYTEST.format(work=work)} {tests}"
    alive, stale = [], []
    for diff in survivors(module):
        (work / module).write_text(pristine)
        body = diff.split("\n", 1)[1]  # after cosmic-ray's "--- mutation diff ---" line
        patch = subprocess.run(
            ["patch", "-p1", "-s", "--no-backup-if-mismatch", "-r", "-"],
            input=body.encode(),
            cwd=work,
            capture_output=True,
        )
        if patch.returncode != 0:
            stale.append(diff)
        elif subprocess.run(command, shell=True, cwd=work, capture_output=True).returncode == 0:
            alive.append(diff)
    shutil.rmtree(work)
    return alive, stale


def main(argv: list[str]) -> int:
    if argv == ["--report"]:
        print(report())
        return 0
    if argv[:1] == ["--recheck"]:
        for module in argv[1:]:
            alive, stale = recheck(module)
            print("\n".join(alive))
            if stale:
                print("no longer apply:\n" + "\n".join(stale))
            print(
                f"{module}: {len(alive)} of {len(survivors(module))} survivors still pass its tests"
                + (f", {len(stale)} no longer apply to it" if stale else "")
            )
        return 0
    if argv == ["--survivors"]:
        for module in MODULES:
            for diff in survivors(module) if counts(module) else ():
                print(diff)
        return 0
    for module in argv or list(MODULES):
        if module not in MODULES:
            raise SystemExit(f"{module}: not one of {', '.join(MODULES)}")
        _run(module)
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
