"""fourd's ring all-reduce against gloo's own all_reduce, on real gloo process groups.

One launch of 8 workers serves every case: groups of 2, 3, 4 and 8 ranks are real gloo
subgroups of that world, and the rings of different groups run one after another.
"""

import pytest
import torch
import torch.distributed as dist

from fourd.comm.launch import run_workers
from fourd.comm.ring import ring_all_reduce

pytestmark = pytest.mark.slow  # gloo ranks

WORLD = 8
DIVISIBLE = 24 * 35  # by 2, 3, 4 and 8
NUMELS = {2: [1, 7, 4097], 3: [2, 10, 1000], 4: [3, 13, 4094], 8: [5, 9, 63]}
SCATTERED = [1, 3, 6]  # group ranks 0, 1, 2 are world ranks 1, 3, 6


def _shapes(n):
    return [(k,) for k in NUMELS[n]] + [(3, 5, 7), (DIVISIBLE,)]


def _integers(shape, seed):
    # integer-valued floats: every summation order gives the same exact result
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, shape, generator=g).float()


def _check(x, group, op=dist.ReduceOp.SUM, segment_bytes=1 << 20):
    want = x.clone()
    dist.all_reduce(want, op=op, group=group)
    stats = ring_all_reduce(x, group=group, op=op, segment_bytes=segment_bytes)
    return torch.equal(x, want), stats


def _all_cases(rank, world):
    groups = {n: dist.new_group(list(range(n))) for n in NUMELS}
    scattered = dist.new_group(SCATTERED)
    out = {}
    for n, group in groups.items():
        if rank < n:
            out[n] = [
                _check(_integers(s, seed=100 * i + rank), group) for i, s in enumerate(_shapes(n))
            ]
    if rank in SCATTERED:
        out["scattered"] = _check(_integers((37,), seed=rank), scattered)
    if rank < 4:
        g = torch.Generator().manual_seed(rank)
        factors = torch.randint(1, 4, (9, 7), generator=g) * (
            2 * torch.randint(0, 2, (9, 7), generator=g) - 1
        )
        out["product"] = _check(factors.float(), groups[4], dist.ReduceOp.PRODUCT)
        out["min"] = _check(_integers((1001,), seed=rank + 7), groups[4], dist.ReduceOp.MIN)
        strided = _integers((12, 10), seed=rank + 11).t()  # a transposed view: not contiguous
        want = strided.contiguous()
        dist.all_reduce(want, group=groups[4])
        ring_all_reduce(strided, group=groups[4])
        out["strided"] = (torch.equal(strided, want), strided.is_contiguous())
    if rank < 3:
        # 64-byte segments cut each 251-element chunk into 16 uneven pieces, all in flight at once
        out["segmented_max"] = _check(
            _integers((751,), seed=rank), groups[3], dist.ReduceOp.MAX, 64
        )
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_all_cases, WORLD, timeout_s=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", sorted(NUMELS))
def test_ring_equals_all_reduce_and_sends_the_lower_bound(results, n):
    for rank in range(n):
        cases = results[rank][n]
        for (equal, stats), shape in zip(cases, _shapes(n)):
            numel = torch.Size(shape).numel()
            chunk = -(-numel // n)
            assert equal, (n, rank, shape)
            assert stats.steps == 2 * (n - 1)
            assert stats.pad_elems == chunk * n - numel
            assert stats.bytes_sent == 2 * (n - 1) * chunk * 4
        equal, stats = cases[-1]
        assert stats.pad_elems == 0
        assert stats.bytes_sent * n == 2 * (n - 1) * DIVISIBLE * 4  # exactly 2(N-1)/N of the tensor
    assert all(n not in results[rank] for rank in range(n, WORLD))


@pytest.mark.timeout(180)
def test_ring_on_a_scattered_subgroup(results):
    for rank in range(WORLD):
        if rank not in SCATTERED:
            assert "scattered" not in results[rank]
            continue
        equal, stats = results[rank]["scattered"]
        assert equal
        assert (stats.world, stats.steps, stats.pad_elems) == (3, 4, 2)
        assert stats.bytes_sent == 4 * 13 * 4


@pytest.mark.timeout(180)
def test_segmented_chunks_and_max(results):
    for rank in range(3):
        equal, stats = results[rank]["segmented_max"]
        assert equal
        assert stats.messages == 4 * 16
        assert stats.bytes_sent == 4 * 251 * 4


@pytest.mark.timeout(180)
def test_product_min_and_a_non_contiguous_tensor(results):
    for rank in range(4):
        assert results[rank]["product"][0], rank
        assert results[rank]["min"][0], rank
        assert results[rank]["strided"] == (True, False), (
            rank
        )  # reduced in place, still the caller's view
