"""fourd.comm.launch, the launcher of the comm benchmark, calibration and the multi-rank tests: results by rank,
and fast failure with the rank's traceback."""

import time

import pytest
import torch
import torch.distributed as dist
from dist_util import run_ranks

pytestmark = pytest.mark.slow  # gloo ranks


def _sum_of_ranks(rank, world, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (rank, t.item() * scale, torch.get_num_threads())


def _rank_one_raises(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _rank_zero_hangs(rank, world):
    if rank == 0:
        time.sleep(60)


@pytest.mark.timeout(60)
def test_results_come_back_by_rank():
    assert run_ranks(_sum_of_ranks, 3, 2.0) == [(0, 6.0, 1), (1, 6.0, 1), (2, 6.0, 1)]


@pytest.mark.timeout(60)
def test_a_failing_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed.*ValueError: boom on purpose"):
        run_ranks(_rank_one_raises, 2, timeout=50)
    assert time.monotonic() - start < 40


@pytest.mark.timeout(60)
def test_a_hanging_rank_is_killed_at_the_timeout():
    # the timeout also bounds each rank's start and rendezvous: 3 s was too short on a loaded
    # machine (rank 1 gave up joining before rank 0 came up, and the test saw that failure)
    with pytest.raises(RuntimeError, match=r"ranks \[0\] did not finish within 15 s"):
        run_ranks(_rank_zero_hangs, 2, timeout=15)
