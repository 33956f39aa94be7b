"""The tests' multi-rank helper: fourd.comm.launch.run_workers, called as run_ranks(fn, world, *args, timeout=...)."""

from fourd.comm.launch import run_workers


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    return run_workers(fn, world, args, timeout_s=timeout)
