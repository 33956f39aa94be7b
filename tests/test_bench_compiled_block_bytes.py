"""benchmarks/compiled_block_bytes.py: the bytes inductor's generated kernels move for a compiled block
grow with the tokens alone, so the difference of two batch sizes is a per-token figure, and the script
prints it beside the planner's own count of the same block."""

import subprocess
import sys

import pytest
from conftest import ROOT

from fourd.model.config import get_preset

SHAPE = "64,4,2,176"  # the debug model's block


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compiled_block_bytes
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return compiled_block_bytes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_generated_kernels_bytes_grow_by_the_same_amount_a_token():
    """Batches of 2, 4 and 6 sequences: each step of 2 sequences adds the same bytes, forward and
    backward, and forward adds some (the norms, RoPE, SwiGLU and the adds are generated kernels)."""
    bench = _bench()
    bench.install_counter()
    cfg = get_preset("debug")
    two, four, six = (bench.compiled_bytes(cfg, batch) for batch in (2, 4, 6))
    for graph in (0, 1):
        assert four[graph] - two[graph] == six[graph] - four[graph] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_script_prints_the_planners_counts_beside_inductors():
    bench = _bench()
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compiled_block_bytes.py"), "--shape", SHAPE],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.splitlines()
    assert out[0] == "block dim 64, 4 heads (2 K/V), FFN 176: bytes a token, forward / backward"
    cfg = get_preset("debug")
    for line, compiled in ((out[2], True), (out[3], False)):
        forward, backward = bench.planned_bytes(cfg, compiled)
        assert line.split()[-3:] == [f"{forward:,.0f}", "/", f"{backward:,.0f}"]
    inductor = out[1].split()
    assert int(inductor[-3].replace(",", "")) > 0 and int(inductor[-1].replace(",", "")) > 0
