"""`fourd bench comm`: rows in nccl-tests' conventions, from real gloo workers."""

import json
import os
import subprocess
import sys

import pytest

from fourd.comm.bench import busbw_factor, parse_bytes, sweep_sizes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # gloo ranks


def _fourd(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "fourd", *args], env=env, capture_output=True, text=True, timeout=150
    )


def test_sizes_and_factors():
    assert (
        parse_bytes("1K") == 1024 and parse_bytes("64M") == 64 << 20 and parse_bytes("4096") == 4096
    )
    assert sweep_sizes(1 << 10, 256 << 20) == [1 << p for p in range(10, 29)]
    assert busbw_factor("all_reduce", 4) == busbw_factor("ring", 4) == 1.5
    assert (
        busbw_factor("all_gather", 8)
        == busbw_factor("reduce_scatter", 8)
        == busbw_factor("all_to_all", 8)
        == 0.875
    )
    assert busbw_factor("broadcast", 8) == busbw_factor("sendrecv", 8) == 1.0


def test_bad_size_is_one_line_and_exit_2():
    done = _fourd("bench", "comm", "--max-bytes", "64Q")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "fourd: error: bad size '64Q': give a positive byte count such as 4096, 64K, 16M or 1G"
    ]


def test_json_rows_for_every_op_over_three_ranks():
    done = _fourd(
        "bench",
        "comm",
        "--op",
        "all",
        "--nproc",
        "3",
        "--max-bytes",
        "2K",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    ops = [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "all_to_all",
        "ring",
        "sendrecv",
    ]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        (op, b) for op in ops for b in (1020, 2040)
    ]  # rounded to 3 ranks
    for r in rows:
        assert r["nproc"] == 3 and r["iters"] == 2 and r["backend"] == "gloo" and r["time_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-12)
        assert r["busbw_gbps"] == pytest.approx(
            r["algbw_gbps"] * busbw_factor(r["op"], 3), rel=1e-12
        )
    ring = [r for r in rows if r["op"] == "ring"]
    assert [(r["steps"], r["bytes_sent_per_rank"]) for r in ring] == [
        (4, 1360),
        (4, 2720),
    ]  # 2(n-1)/n of the buffer
