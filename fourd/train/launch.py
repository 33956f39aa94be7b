"""Start training workers through PyTorch's elastic launcher, even for one process, so that the path a
laptop takes is the path `torchrun` takes across nodes (c10d rendezvous, restarts, worker env vars)."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import uuid

from fourd.errors import FourdError


def under_torchrun() -> bool:
    """True when this process is itself a worker started by torchrun / an elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, max_restarts: int, entrypoint, *args) -> int:
    """Run entrypoint(*args) in nproc local workers; returns the exit status fourd should give."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"fourd-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="fourd-elastic-")),
    )
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes == {2}:
            return 2  # a worker refused bad input and already said why on stderr
        rank, failure = min(e.failures.items())
        why = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        raise FourdError(
            f"worker rank {rank} failed ({why}) after {max_restarts} restart(s); "
            "its error is above; --max-restarts R restarts the job from the newest checkpoint"
        ) from None
    return 0
