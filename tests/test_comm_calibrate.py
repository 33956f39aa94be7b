"""`fourd calibrate --quick` on this machine: a profile the planner loads, with sane figures."""

import os
import subprocess
import sys

import pytest

from fourd.plan.calibrate import DEVICES, PLANS, SHAPES, fit_alpha_beta

pytestmark = pytest.mark.timeout(240)


def test_fit_recovers_alpha_and_beta_exactly():
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 24]
    alpha, beta = fit_alpha_beta([(s, 2.5e-4 + 1e-9 * s) for s in sizes])
    # the median small-message time carries beta·bytes of its own; the slope fit then returns beta
    assert alpha == pytest.approx(2.5e-4 + 1e-9 * ((1 << 10) + (1 << 14)) / 2, rel=1e-12)
    assert beta == pytest.approx(1e-9, rel=2e-4)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    home = tmp_path_factory.mktemp("fourd-home")
    env = dict(os.environ, FOURD_HOME=str(home), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "fourd", "calibrate", "--quick"], env=env, capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr
    path = home / "clusters" / "local.toml"
    assert path.is_file() and f"wrote {path}" in done.stdout
    old = os.environ.get("FOURD_HOME")
    os.environ["FOURD_HOME"] = str(home)
    try:
        from fourd.plan.cluster import load_cluster

        return load_cluster("local")
    finally:
        if old is None:
            del os.environ["FOURD_HOME"]
        else:
            os.environ["FOURD_HOME"] = old


def test_profile_has_every_figure_positive(local):
    assert local.name == "local" and local.dtype == "fp32"
    assert local.node.gpus == DEVICES and local.node.concurrent_ranks == os.cpu_count()
    for value in (
        local.gpu.peak_tflops,
        local.gpu.memory_gb,
        local.gpu.hbm_bw_gbps,
        local.node.intra_bw_gbps,
        local.node.intra_latency_us,
        local.network.nic_bw_gbps,
        local.network.latency_us,
    ):
        assert value > 0
    # the best matmul the machine does is its peak, which no single sample exceeds
    assert local.gpu.peak_tflops >= max(g.tflops for g in local.gpu.gemm)


def test_matmul_throughput_rises_with_size_while_overhead_dominates(local):
    sizes = [g.m for g in local.gpu.gemm]
    assert sizes == list(PLANS["quick"][0])
    assert all((g.m, g.n, g.k) == (g.m, g.m, g.m) and g.tflops > 0 for g in local.gpu.gemm)
    small = [g.tflops for g in local.gpu.gemm if g.m <= 128]
    assert small == sorted(small) and small[-1] > 4 * small[0]


def test_training_shapes_attention_and_eager_rates_are_measured(local):
    tokens, dims, seqs, head_dims = SHAPES["quick"]
    want = set()
    for t in tokens:
        for d_in in dims:
            for d_out in dims:
                want |= {(t, d_out, d_in), (t, d_in, d_out), (d_in, d_out, t)}
    shapes = [(g.m, g.n, g.k) for g in local.gpu.gemm_shapes]
    # three per (tokens, in, out); the forward and input-gradient shapes coincide when in and out swap
    assert len(shapes) == 3 * len(tokens) * len(dims) ** 2 and set(shapes) == want
    assert all(g.tflops > 0 for g in local.gpu.gemm_shapes)
    assert [(a.seq, a.head_dim) for a in local.gpu.attention] == [(s, d) for s in seqs for d in head_dims]
    assert all(
        min(a.fwd_tflops, a.bwd_tflops, a.masked_fwd_tflops, a.masked_bwd_tflops) > 0 for a in local.gpu.attention
    )
    assert local.gpu.elementwise_gbps > 0 and local.gpu.optimizer_gbps > 0


def test_collective_fits_cover_every_op_and_group(local):
    fits = {(c.op, c.nproc): c for c in local.collectives}
    want = {(op, g) for op in ("all_reduce", "all_gather", "reduce_scatter") for g in PLANS["quick"][1]} | {("send", 2)}
    assert set(fits) == want
    for c in fits.values():
        assert c.alpha_s > 0 and c.beta_s_per_byte > 0
    send = fits[("send", 2)]
    assert local.node.intra_bw_gbps == pytest.approx(1 / send.beta_s_per_byte / 1e9, rel=1e-3)
    assert local.node.intra_latency_us == pytest.approx(send.alpha_s * 1e6, rel=1e-3)


def test_planner_times_collectives_with_the_fit(local):
    from fourd.plan.cluster import Group
    from fourd.plan.perf import collective_time

    fit = next(c for c in local.collectives if (c.op, c.nproc) == ("all_reduce", 4))
    assert collective_time("all_reduce", 1 << 20, Group(4, 1, 4), local) == fit.alpha_s + fit.beta_s_per_byte * (
        1 << 20
    )


def test_fit_falls_back_to_an_upper_bound_when_latency_noise_swamps_it():
    # small messages delayed by other work: the slope would come out negative
    alpha, beta = fit_alpha_beta([(1 << 10, 9e-3), (1 << 14, 8e-3), (1 << 20, 2e-3), (1 << 22, 4e-3)])
    assert alpha == pytest.approx(8.5e-3)
    assert beta == 4e-3 / (1 << 22)
