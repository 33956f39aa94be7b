"""`fourd calibrate --quick` on this machine: a profile the planner loads, with the figures it measured; and
the CUDA path's profile from the same code."""

import os
import subprocess
import sys

import pytest

from fourd.measure.calibrate import (
    CPU_DEVICES,
    PLANS,
    fit_alpha_beta,
    median_figures,
    profile_toml,
    training_gemms,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # gloo ranks


def test_fit_recovers_alpha_and_beta_exactly():
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 24]
    alpha, beta = fit_alpha_beta([(s, 2.5e-4 + 1e-9 * s) for s in sizes])
    # the median small-message time carries beta·bytes of its own; the slope fit then returns beta
    assert alpha == pytest.approx(2.5e-4 + 1e-9 * ((1 << 10) + (1 << 14)) / 2, rel=1e-12)
    assert beta == pytest.approx(1e-9, rel=2e-4)


def test_fit_falls_back_to_an_upper_bound_when_latency_noise_swamps_it():
    # small messages delayed by other work: the slope would come out negative
    alpha, beta = fit_alpha_beta(
        [(1 << 10, 9e-3), (1 << 14, 8e-3), (1 << 20, 2e-3), (1 << 22, 4e-3)]
    )
    assert alpha == pytest.approx(8.5e-3)
    assert beta == 4e-3 / (1 << 22)


def test_rounds_keep_each_measured_figure_s_median_and_what_is_read_once():
    rounds = [
        {
            "name": "cpu",
            "devices": 8,
            "peak_tflops": 0.2,
            "gemm": [(16, 0.01), (32, 0.03)],
            "fits": {("all_reduce", 2): (5e-4, 1e-9)},
            "sms": None,
        },
        {
            "name": "cpu",
            "devices": 8,
            "peak_tflops": 0.1,
            "gemm": [(16, 0.02), (32, 0.01)],
            "fits": {("all_reduce", 2): (9e-4, 3e-9)},
            "sms": None,
        },
        {
            "name": "cpu",
            "devices": 8,
            "peak_tflops": 0.3,
            "gemm": [(16, 0.04), (32, 0.02)],
            "fits": {("all_reduce", 2): (1e-4, 2e-9)},
            "sms": None,
        },
    ]
    assert median_figures(rounds) == {
        "name": "cpu",
        "devices": 8,
        "peak_tflops": 0.2,
        "gemm": [(16, 0.02), (32, 0.02)],
        "fits": {("all_reduce", 2): (5e-4, 2e-9)},
        "sms": None,
    }
    assert median_figures(rounds[:1]) == rounds[0]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    home = tmp_path_factory.mktemp("fourd-home")
    env = dict(os.environ, FOURD_HOME=str(home), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "fourd", "calibrate", "--quick", "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    path = home / "clusters" / "local.toml"
    assert path.is_file() and f"wrote {path}" in done.stdout
    from fourd.plan.cluster import load_cluster

    return load_cluster(str(path))


def test_profile_describes_this_machine(local):
    assert local.name == "local" and local.dtype == "fp32" and local.cpu
    assert local.node.gpus == CPU_DEVICES and local.node.concurrent_ranks == os.cpu_count()
    assert [g.m for g in local.gpu.gemm] == list(PLANS["quick"].squares)
    assert all((g.m, g.n, g.k) == (g.m, g.m, g.m) for g in local.gpu.gemm)
    for value in (
        local.gpu.peak_tflops,
        local.gpu.hbm_bw_gbps,
        local.gpu.elementwise_gbps,
        local.gpu.optimizer_gbps,
    ):
        assert value > 0
    assert local.gpu.tp_layer_us >= 0 and local.gpu.fsdp_layer_us >= 0
    # measured: shares of the compute, never negative, TP's pattern and FSDP's
    assert 0 <= local.node.sync_share < 2 and 0 <= local.node.layer_sync_share < 2
    assert local.node.fsdp_sync_share is not None


def test_training_shapes_and_attention_are_measured(local):
    sweep = PLANS["quick"]
    want = set()
    for t in sweep.tokens:
        for d_in in sweep.dims:
            for d_out in sweep.dims:
                want |= {(t, d_out, d_in), (t, d_in, d_out), (d_in, d_out, t)}
    shapes = [(g.m, g.n, g.k) for g in local.gpu.gemm_shapes]
    # three per (tokens, in, out); the forward and input-gradient shapes coincide when in and out swap
    assert len(shapes) == 3 * len(sweep.tokens) * len(sweep.dims) ** 2 and set(shapes) == want
    assert [(a.seq, a.head_dim) for a in local.gpu.attention] == [
        (s, d) for s in sweep.seqs for d in sweep.head_dims
    ]


def test_collective_fits_cover_every_op_and_group_and_the_planner_uses_them(local):
    from fourd.plan.cluster import Group
    from fourd.plan.kernels import collective_time

    fits = {(c.op, c.nproc): c for c in local.collectives}
    ops = ("all_reduce", "all_gather", "reduce_scatter")
    assert set(fits) == {(op, g) for op in ops for g in PLANS["quick"].groups} | {("send", 2)}
    send = fits[("send", 2)]
    assert local.node.intra_bw_gbps == pytest.approx(1 / send.beta_s_per_byte / 1e9, rel=1e-3)
    assert local.node.intra_latency_us == pytest.approx(send.alpha_s * 1e6, rel=1e-3)
    fit = fits[("all_reduce", 4)]
    assert collective_time(
        "all_reduce", 1 << 20, Group(4, 1, 4), local
    ) == fit.alpha_s + fit.beta_s_per_byte * (1 << 20)


def test_the_cuda_path_writes_a_gpu_profile_from_the_same_code(tmp_path):
    from fourd.plan.cluster import load_cluster

    # the training-shape sweep is the code the CUDA path runs, here on the CPU device
    rows = training_gemms([64], [32], device="cpu", seconds=0.001)
    assert [r[:3] for r in rows] == [(64, 32, 32), (64, 32, 32), (32, 32, 64)] and all(
        r[3] > 0 for r in rows
    )
    m = {
        "name": "NVIDIA H200",
        "memory_gb": 150.0,
        "sms": 132,
        "devices": 1,
        "peak_tflops": 989.0,
        "copy_gbps": 4000.0,
        "gemm": [(4096, 700.0)],
        "gemm_shapes": rows,
        "attention": [(2048, 128, 400.0, 300.0, 200.0, 150.0)],
        "elementwise_gbps": 2500.0,
        "optimizer_gbps": 3000.0,
        "fits": {},
    }
    path = tmp_path / "gpu.toml"
    path.write_text(profile_toml(m, "fourd calibrate --device cuda"))
    gpu = load_cluster(str(path))
    assert (gpu.dtype, gpu.gpu.sms, gpu.gpu.peak_tflops, gpu.node.gpus, gpu.cpu) == (
        "bf16",
        132,
        989.0,
        1,
        False,
    )
    assert (gpu.gpu.elementwise_gbps, gpu.gpu.gemm[0].tflops, gpu.gpu.attention[0].bwd_tflops) == (
        2500.0,
        700.0,
        300.0,
    )
    assert (
        gpu.node.intra_bw_gbps == 4000.0
    )  # no second device: its own copy rate stands in for the links
