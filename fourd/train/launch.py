"""Start training workers through PyTorch's elastic launcher, even for one process, so that the path a laptop
takes is the path `torchrun` takes across nodes (c10d rendezvous, restarts, worker env vars).

The launcher and its workers share a temporary folder ($FOURD_LAUNCH_DIR): a worker that fails leaves its
one-line error there (rank-R.json) for the launcher to print once, and a SIGINT or SIGTERM that reaches the
launcher alone is passed on as the file `stop`, read by every worker at each step boundary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from fourd.comm.launch import free_port
from fourd.errors import FourdError, RunFailed, plural

LAUNCH_DIR_ENV = "FOURD_LAUNCH_DIR"


def attempt() -> int:
    """How many times the elastic agent has restarted this worker's job."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def under_torchrun() -> bool:
    """True when this process is itself a worker started by torchrun / an elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def outcome(results) -> int:
    """The exit status of workers that returned: 0, 128 + the signal that stopped them, or RunFailed
    (a message)."""
    for r in results:
        if isinstance(r, str):
            raise RunFailed(r)
    return 128 + max(results) if max(results) else 0


@contextlib.contextmanager
def _signals_to_file(folder: Path):
    """While workers run, SIGINT and SIGTERM write `stop` for them instead of ending this process; a
    second one (workers hung in a collective never reach a step boundary) ends it, and the agent
    then ends the workers."""
    got: list[int] = []

    def stop(signum, frame):
        if got:
            raise KeyboardInterrupt
        got.append(signum)
        (folder / "stop").write_text(str(signum))

    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _failure(e, folder: Path, max_restarts: int) -> FourdError:
    """One line for a failed launch: the earliest error a worker of the last attempt left, else how
    it died."""
    reports = [json.loads(p.read_text()) for p in folder.glob("rank-*.json")]
    if reports:
        last = [r for r in reports if r["attempt"] == max(r["attempt"] for r in reports)]
        refused = [
            r for r in last if r["code"] == 2
        ]  # bad input: every rank says it, rank 0 with the most context
        if refused:
            return FourdError(min(refused, key=lambda r: r["rank"])["message"])
        first = min(last, key=lambda r: r["time"])  # a failure: the rank that met it first
        return RunFailed(
            f"{first['message']} (after {plural(max_restarts, 'restart')}; --debug shows the "
            "traceback)"
        )
    rank, failure = min(e.failures.items())
    why = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return RunFailed(
        f"worker rank {rank} died ({why}) after {plural(max_restarts, 'restart')}: "
        "--max-restarts R restarts the job from the newest checkpoint"
    )


# multiprocessing's forkserver listens on TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, an AF_UNIX socket
# whose path may hold 107 bytes on Linux (sockaddr_un.sun_path)
_SOCKET_PATH_MAX = 107
_FORKSERVER_SOCKET_NAME = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def _forkserver_fits() -> bool:
    """True when multiprocessing's forkserver socket fits below this TMPDIR; else workers spawn."""
    return len(tempfile.gettempdir()) + _FORKSERVER_SOCKET_NAME <= _SOCKET_PATH_MAX


def _start_method(preload: list[str]) -> str:
    """'forkserver' preloading `preload` when modules to preload are given and its socket fits, so
    each worker forks from a process that has imported torch and fourd once (seconds saved per
    worker: an 8-rank debug run 28.2 -> 15.2 s, single runs of 2026-12-04); else 'spawn', a fresh
    interpreter per worker."""
    if not preload or not _forkserver_fits():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


def _with_launch_env(launch_env: dict[str, str], entrypoint, *args):
    """entrypoint(*args) in a worker with this launch's FOURD_* variables: a forkserver started by
    an earlier launch of the same process holds that launch's environment, not this one's."""
    for name in [name for name in os.environ if name.startswith("FOURD_")]:
        del os.environ[name]
    os.environ.update(launch_env)
    return entrypoint(*args)


def launch_local(
    nproc: int, max_restarts: int, entrypoint, *args, preload: tuple[str, ...] = ()
) -> int:
    """Run entrypoint(*args) in nproc local workers; returns the exit status fourd should give.
    `preload` names modules a forkserver imports once for all workers (CPU runs); without it each
    worker is a fresh spawned interpreter."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not os.environ.get("FOURD_DEBUG"):
        for name in list(logging.root.manager.loggerDict):
            if name.startswith(
                ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
            ):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with (
        tempfile.TemporaryDirectory(prefix="fourd-elastic-") as tmp,
        _signals_to_file(Path(tmp)) as got,
    ):
        os.environ[LAUNCH_DIR_ENV] = tmp
        kw = dict(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"fourd-{uuid.uuid4().hex[:8]}"
        )
        kw |= dict(
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            rdzv_configs={"timeout": 120},
        )
        start_method = _start_method(list(preload))
        kw |= dict(max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method)
        # not SIGINT and SIGTERM: the agent would turn them into an exception that kills unsaved
        # workers
        kw |= dict(
            signals_to_handle="SIGHUP,SIGQUIT",
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")),
        )
        try:
            launch_env = {
                name: value for name, value in os.environ.items() if name.startswith("FOURD_")
            }
            workers = elastic_launch(LaunchConfig(**kw), _with_launch_env)
            results = workers(launch_env, entrypoint, *args)
        except ChildFailedError as e:
            if got:
                print(
                    f"fourd: stopped by {signal.Signals(got[0]).name} before a checkpoint",
                    file=sys.stderr,
                )
                return 128 + got[0]
            raise _failure(e, Path(tmp), max_restarts) from None
    return outcome(list(results.values()))
