"""The launcher's side of the contract's `fourd train` lines, in this process (no training, under a second):

- started directly, `fourd train` launches its own workers; it runs as the worker only when an elastic agent
  (torchrun) started it: both TORCHELASTIC_RUN_ID and LOCAL_RANK set, not LOCAL_RANK alone (Slurm scripts and
  other launchers set that);
- SIGINT and SIGTERM to the launcher while workers run are passed on as the file `stop` (the workers read it
  at each step boundary), the launcher itself keeps running; a second signal ends it; its handlers are
  restored afterwards;
- without `--run-dir` each run gets a fresh directory under `runs/`, named after the model, the layout and
  the time, `-2`, `-3`, ... when runs start in the same second, each with its `config.toml`.
"""

from __future__ import annotations

import os
import signal

import pytest
import tomllib

from fourd.config import Config, set_value
from fourd.train import cli
from fourd.train.launch import _signals_to_file, under_torchrun


@pytest.mark.parametrize(
    "variables,worker",
    [
        ({"TORCHELASTIC_RUN_ID": "job", "LOCAL_RANK": "0"}, True),
        ({"LOCAL_RANK": "0"}, False),
        ({"TORCHELASTIC_RUN_ID": "job"}, False),
        ({}, False),
    ],
)
def test_only_an_elastic_agents_worker_runs_as_the_worker(monkeypatch, variables, worker):
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert under_torchrun() is worker


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_becomes_the_workers_stop_file_and_a_second_ends_it(
    tmp_path, first
):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with _signals_to_file(tmp_path) as got:
        try:
            os.kill(os.getpid(), first)  # delivered before os.kill returns: the handler has run
        except KeyboardInterrupt:
            pytest.fail(
                f"the first {first.name} ended the launcher instead of stopping the workers"
            )
        assert got == [first]
        assert (tmp_path / "stop").read_text() == str(int(first))
        with pytest.raises(
            KeyboardInterrupt
        ):  # workers hung in a collective: a second ends the wait
            os.kill(os.getpid(), signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before


def test_runs_without_run_dir_get_fresh_directories_under_runs(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.time, "strftime", lambda form: "20261205-171500")  # one second for all
    made = []
    for layout in ("dp=1", "dp=1", "tp=2,pp=2", "dp=1"):
        cfg = Config()
        set_value(cfg, "model.preset", "debug")
        set_value(cfg, "parallel.layout", layout)
        cli._start(cfg)
        made.append(cfg.run.dir)
        recorded = tomllib.loads((tmp_path / cfg.run.dir / "config.toml").read_text())
        assert recorded["run"]["dir"] == cfg.run.dir
    assert made == [
        "runs/debug-dp1-20261205-171500",
        "runs/debug-dp1-20261205-171500-2",
        "runs/debug-tp2-pp2-20261205-171500",
        "runs/debug-dp1-20261205-171500-3",
    ]


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM])
def test_a_worker_takes_sigint_and_sigterm_as_a_request_to_stop(sent):
    """The worker's handlers, as `worker_entry` installs them: the signal is remembered for the next step
    boundary, the process goes on."""
    from fourd.train import worker

    def ends(signum, frame):  # what the signal would do without the worker's handler: end it
        raise AssertionError(
            f"{signal.Signals(signum).name} ended the worker instead of asking it to stop"
        )

    before = {s: signal.signal(s, ends) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        worker.listen_for_stop()
        worker._STOP["signal"] = 0
        os.kill(os.getpid(), sent)  # delivered before os.kill returns
        assert worker._STOP["signal"] == sent
    finally:
        worker._STOP["signal"] = 0
        for number, handler in before.items():
            signal.signal(number, handler)
