"""Cluster profiles and where each parallel group lands in them (fourd.plan.cluster), worked out by hand on
a small profile: 8 GPUs a server, 16 a rack, 32 a pod; NVLink 450 GB/s at 0.8, a 50 GB/s NIC per GPU at
0.9, pods joined at 4:1.

Written for `make mutation-pure MODULES=fourd/plan/cluster.py` (2026-12-05): each test names the rule it
holds."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

import pytest

from fourd.errors import FourdError
from fourd.layout import Layout
from fourd.plan.cluster import (
    AttentionSample,
    CollectiveSample,
    GemmSample,
    Group,
    group_bandwidth,
    group_level,
    group_levels,
    load_cluster,
    members_per_node,
    placement,
    replica_group,
    shard_group,
)

PROFILE = """name = "small"
description = "8 GPUs a server, 16 a rack, 32 a pod"
[gpu]
name = "H100 SXM 80GB"
peak_tflops = 989.0
memory_gb = 80.0
hbm_bw_gbps = 3350.0
sms = 132
[node]
gpus = 8
intra_bw_gbps = 450.0
intra_latency_us = 5.0
intra_efficiency = 0.8
[network]
nic_bw_gbps = 50.0
latency_us = 10.0
nic_efficiency = 0.9
gpus_per_rack = 16
gpus_per_pod = 32
cross_pod_oversubscription = 4.0
"""


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(PROFILE)
    return load_cluster(str(path))


def test_tp_8_is_inside_a_server_and_a_single_rank_is_nowhere(small):
    assert group_levels(Group(8, 1, 64), small) == {"nvlink": 8}
    assert group_level(Group(8, 1, 64), small) == "nvlink"
    assert group_levels(Group(1, 1, 8), small) == {}
    assert group_level(Group(1, 1, 8), small) == "single"


def test_tp_3_on_8_gpu_servers_straddles_servers_racks_and_counts_each_group():
    """Groups of 3 in 24 ranks start at 0, 3, ..., 21: six lie inside a server, 6-8 crosses two servers of
    rack 0, 15-17 crosses from rack 0 to rack 1 (one pod); each has a single member on one server."""
    cluster = _profile()
    assert group_levels(Group(3, 1, 24), cluster) == {"nvlink": 6, "rack": 1, "pod": 1}
    assert group_level(Group(3, 1, 24), cluster) == "pod"
    assert members_per_node(Group(3, 1, 24), cluster) == 1


def test_strided_groups_land_by_their_reach(small):
    # ranks r and r + 8: two servers of one rack; r, r + 16, r + 32, r + 48: two pods
    assert group_levels(Group(2, 8, 16), small) == {"rack": 8}
    assert group_levels(Group(4, 16, 64), small) == {"cross-pod": 16}
    assert members_per_node(Group(4, 16, 64), small) == 1  # a stride of a server or more: one each
    # 16 consecutive ranks: two whole servers, eight members on each
    assert group_levels(Group(16, 1, 64), small) == {"rack": 4}
    assert members_per_node(Group(16, 1, 64), small) == 8


def test_a_group_of_2_per_server_counts_2_members(small):
    # stride 4 over 16 ranks: r, r+4, r+8, r+12 with r in 0..3: two members on each of two servers
    assert group_levels(Group(4, 4, 16), small) == {"rack": 4}
    assert members_per_node(Group(4, 4, 16), small) == 2


def test_bandwidth_and_latency_of_a_ring_by_where_it_lies(small):
    nvlink, nic = 450e9 * 0.8, 50e9 * 0.9
    within, across = 5.0 * 1e-6, 10.0 * 1e-6  # the profile's microseconds
    assert group_bandwidth(Group(8, 1, 64), small) == (nvlink, within)
    # across servers each member per server drives its own NIC, capped by NVLink
    assert group_bandwidth(Group(2, 8, 16), small) == (nic, across)
    assert group_bandwidth(Group(4, 4, 16), small) == (2 * nic, across)
    assert group_bandwidth(Group(16, 1, 64), small) == (min(nvlink, 8 * nic), across)
    assert group_bandwidth(Group(16, 1, 64), small, channels=1) == (nic, across)
    # across pods: 32 GPUs of a pod, 2 members of each group in a pod, 1 channel each: 16 channels
    # cross; the pod's 32 NICs' worth of uplink at 4:1 over 16 is 0.5 NIC each
    assert group_bandwidth(Group(4, 16, 64), small) == (0.5 * nic, across)


def test_each_dimension_of_a_layout_is_placed_innermost_first():
    lay = Layout(2, 3, 4, 5)
    assert placement(lay) == {
        "tp": Group(2, 1, 120),
        "cp": Group(3, 2, 120),
        "pp": Group(4, 6, 120),
        "dp": Group(5, 24, 120),
    }


def test_the_shard_group_is_cp_times_dp_and_hsdp_cuts_it_into_replicas():
    assert shard_group(Layout(2, 2, 2, 1)) == Group(2, 2, 8)  # CP alone: stride TP
    assert shard_group(Layout(2, 2, 2, 4)) == Group(8, 4, 32)  # cp·dp, stride tp·pp
    assert shard_group(Layout(2, 2, 2, 4), replicas=2) == Group(4, 4, 32)
    assert replica_group(Layout(2, 2, 2, 4), 2) == Group(2, 16, 32)


def test_cpu_ranks_take_turns_on_the_cores_and_gpus_never(tmp_path):
    path = tmp_path / "cpu.toml"
    path.write_text(
        PROFILE.replace('name = "H100 SXM 80GB"', 'name = "cpu x86"').replace(
            "gpus = 8\n", "gpus = 8\nconcurrent_ranks = 2\n"
        )
    )
    cpu, gpu = load_cluster(str(path)), _profile()
    assert cpu.cpu and not gpu.cpu
    # turns: the busy ranks on one server (at most its 8) over the 2 that run at once, at least 1
    assert [cpu.core_share(ranks) for ranks in (1, 2, 4, 8, 16)] == [1.0, 1.0, 2.0, 4.0, 4.0]
    assert [gpu.core_share(ranks) for ranks in (1, 16)] == [1.0, 1.0]


def test_a_profile_reads_its_tables_and_its_defaults(small):
    assert (small.name, small.description, small.dtype) == (
        "small",
        "8 GPUs a server, 16 a rack, 32 a pod",
        "bf16",
    )
    assert small.gpu.gemm_efficiency == 0.7  # the default when a profile gives none
    assert small.gpu.cudnn_attention_fwd_efficiency is None
    assert (small.node.gpus, small.network.gpus_per_rack, small.network.gpus_per_pod) == (8, 16, 32)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            ("nic_bw_gbps = 50.0", "nic_bw_gbps = 0.0"),
            "network.nic_bw_gbps = 0.0 must be finite, above 0",
        ),
        (("nic_bw_gbps = 50.0", "nic_bw_gbps = -1.0"), "must be finite, above 0"),
        (
            ("latency_us = 10.0", "latency_us = -1.0"),
            "network.latency_us = -1.0 must be finite, at least 0",
        ),
        (("gpus = 8", 'gpus = "8"'), "node.gpus = '8' must be of type int"),
        (("gpus = 8", "gpus = true"), "node.gpus = True must be of type int"),
        (("sms = 132", "sms = 132\nwarp = 4"), "unknown key(s) warp in [gpu]"),
        (("[network]", 'dtype = "fp16"\n[network]'), "unknown key(s) dtype in [node]"),
        (
            ('name = "small"', 'name = "small"\ndtype = "fp16"'),
            "dtype = 'fp16'; allowed: bf16, fp32",
        ),
        (("[network]", "[nope]"), "missing the [network] table"),
        (("hbm_bw_gbps = 3350.0\n", ""), "[gpu] is incomplete"),
        (("peak_tflops = 989.0", "peak_tflops = inf"), "must be finite, above 0"),
    ],
)
def test_a_bad_profile_is_refused_in_one_line_naming_the_key(tmp_path, change, named):
    path = tmp_path / "bad.toml"
    path.write_text(PROFILE.replace(*change, 1))
    with pytest.raises(FourdError) as refused:
        load_cluster(str(path))
    assert named in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_profile_without_its_network_is_refused(tmp_path):
    path = tmp_path / "no-network.toml"
    path.write_text(PROFILE.split("[network]")[0])
    with pytest.raises(FourdError, match=r"missing the \[network\] table; see docs/planner.md"):
        load_cluster(str(path))


def test_zero_is_allowed_where_a_profile_may_have_none_of_it(tmp_path):
    path = tmp_path / "zeros.toml"
    text = PROFILE.replace("latency_us = 10.0", "latency_us = 0.0")
    text = text.replace("intra_latency_us = 5.0", "intra_latency_us = 0")
    path.write_text(
        text.replace("sms = 132", "sms = 132\nmemory_reserve_gb = 0\ntp_layer_us = 0.0")
    )
    cluster = load_cluster(str(path))
    assert (cluster.network.latency_us, cluster.node.intra_latency_us) == (0.0, 0)
    assert (cluster.gpu.memory_reserve_gb, cluster.gpu.tp_layer_us) == (0, 0.0)


def test_a_cpu_profile_s_sync_share_is_read_and_never_negative(tmp_path):
    path = tmp_path / "synced.toml"
    path.write_text(
        PROFILE.replace("gpus = 8\n", "gpus = 8\nconcurrent_ranks = 2\nsync_share = 0.18\n")
    )
    assert load_cluster(str(path)).node.sync_share == 0.18
    # written before calibrate measured FSDP's pattern apart: TP's share stands for it
    assert load_cluster(str(path)).node.layer_sync_share == 0.18
    assert _profile().node.sync_share == 0.0  # GPUs: none unless measured
    path.write_text(
        PROFILE.replace("gpus = 8\n", "gpus = 8\nsync_share = 0.18\nfsdp_sync_share = 0.07\n")
    )
    assert load_cluster(str(path)).node.layer_sync_share == 0.07
    for key in ("sync_share", "fsdp_sync_share"):
        path.write_text(PROFILE.replace("gpus = 8\n", f"gpus = 8\n{key} = -0.1\n"))
        with pytest.raises(FourdError, match=f"node.{key} = -0.1 must be finite, at least 0"):
            load_cluster(str(path))


def test_measured_samples_are_read_and_checked(tmp_path):
    path = tmp_path / "measured.toml"
    samples = (
        "\n[[gpu.gemm]]\nm = 1024\nn = 1024\nk = 1024\ntflops = 0.05\n"
        "[[gpu.attention]]\nseq = 256\nhead_dim = 32\nfwd_tflops = 0.03\nbwd_tflops = 0.025\n"
        '[[collectives]]\nop = "all_reduce"\nnproc = 2\nalpha_s = 0.0\nbeta_s_per_byte = 1e-9\n'
    )
    gpu_samples, collective = samples.split("[[collectives]]")
    path.write_text(
        PROFILE.replace("[node]", gpu_samples + "[node]") + "[[collectives]]" + collective
    )
    cluster = load_cluster(str(path))
    assert [(s.m, s.tflops) for s in cluster.gpu.gemm] == [(1024, 0.05)]
    assert [(s.seq, s.bwd_tflops) for s in cluster.gpu.attention] == [(256, 0.025)]
    assert [(c.op, c.nproc, c.alpha_s) for c in cluster.collectives] == [("all_reduce", 2, 0.0)]
    bad = PROFILE.replace(
        "[node]", gpu_samples.replace("tflops = 0.05", "tflops = -0.05") + "[node]"
    )
    path.write_text(bad)
    with pytest.raises(FourdError, match=r"gpu.gemm.tflops = -0.05 must be finite, above 0"):
        load_cluster(str(path))


def _profile():
    """The small profile, written to a fresh file (for tests without tmp_path)."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    (folder / "small.toml").write_text(PROFILE)
    return load_cluster(str(folder / "small.toml"))


def test_a_group_that_spans_two_servers_counts_its_fewest_members_on_either(small):
    # groups of 3 in 9 ranks: only 6-8 leaves its server, 2 members on the first, 1 on the last
    assert group_levels(Group(3, 1, 9), small) == {"nvlink": 2, "rack": 1}
    assert members_per_node(Group(3, 1, 9), small) == 1


def test_a_stride_of_a_whole_period_counts_each_group_once(small):
    # ranks r and r + 32: two pods, one group per r < 32
    assert group_levels(Group(2, 32, 64), small) == {"cross-pod": 32}


def test_the_pods_uplinks_are_shared_by_every_crossing_channel_unrounded(small):
    """Stride 10 over 40 ranks: a pod holds 3 members of a group (32 // 10), so 32 / 3 channels of the
    pod's cross; its 32 NICs' worth at 4:1 over them is 0.75 NIC each."""
    nic = 50e9 * 0.9
    assert group_level(Group(4, 10, 40), small) == "cross-pod"
    bandwidth, _ = group_bandwidth(Group(4, 10, 40), small)
    assert bandwidth == pytest.approx(32 * nic / 4 / (32 / 3), rel=1e-12)


def test_a_stride_of_two_periods_counts_each_group_once(small):
    # ranks r and r + 64 for r < 64: 64 groups, each across pods
    assert group_levels(Group(2, 64, 128), small) == {"cross-pod": 64}


def test_two_members_a_server_drive_two_channels_across_pods(small):
    """Stride 4 over 64 ranks: 16 members, 2 on each server, the group across both pods: 32 / 8 groups'
    worth of a pod's members, 2 channels each, 8 channels cross; 32 NICs at 4:1 over 8 is a whole NIC
    each, so the ring runs at 2 NICs."""
    nic = 50e9 * 0.9
    assert members_per_node(Group(16, 4, 64), small) == 2
    assert group_bandwidth(Group(16, 4, 64), small)[0] == 2 * nic


def test_a_profile_leaving_out_the_optional_figures_takes_the_documented_defaults(tmp_path):
    path = tmp_path / "bare.toml"
    path.write_text(
        '[gpu]\nname = "x"\npeak_tflops = 1.0\nmemory_gb = 1.0\nhbm_bw_gbps = 1.0\n'
        "[node]\ngpus = 8\nintra_bw_gbps = 1.0\n[network]\nnic_bw_gbps = 1.0\n"
    )
    bare = load_cluster(str(path))
    assert (bare.node.intra_latency_us, bare.node.intra_efficiency, bare.node.concurrent_ranks) == (
        5.0,
        1.0,
        None,
    )
    net = bare.network
    assert (net.latency_us, net.nic_efficiency, net.gpus_per_rack, net.gpus_per_pod) == (
        10.0,
        1.0,
        16,
        3072,
    )
    assert net.cross_pod_oversubscription == 1.0
    assert (bare.name, bare.description, bare.dtype, bare.collectives) == ("bare", "", "bf16", ())
    gpu = bare.gpu
    assert (gpu.sms, gpu.gemm_efficiency, gpu.attention_fwd_efficiency, gpu.memory_reserve_gb) == (
        None,
        0.7,
        None,
        0.0,
    )


def test_at_8_to_1_the_pods_uplinks_halve_each_crossing_channel(tmp_path):
    path = tmp_path / "thin.toml"
    path.write_text(
        PROFILE.replace("cross_pod_oversubscription = 4.0", "cross_pod_oversubscription = 8.0")
    )
    thin, nic = load_cluster(str(path)), 50e9 * 0.9
    # as above, 8 channels cross; 32 NICs at 8:1 over 8 is half a NIC each, two a server
    assert group_bandwidth(Group(16, 4, 64), thin)[0] == 2 * (32 * nic / 8 / 8)


def test_a_strided_group_counts_its_fewest_members_on_its_first_server(small):
    # stride 2 over 12 ranks: 6, 8, 10 and 7, 9, 11 each have one member on server 0, two on server 1
    assert group_levels(Group(3, 2, 12), small) == {"nvlink": 2, "rack": 2}
    assert members_per_node(Group(3, 2, 12), small) == 1


def test_a_profile_named_by_a_relative_toml_file_is_read_from_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text(PROFILE)
    assert load_cluster("mine.toml").name == "small"


SIX = """name = "six"
description = "6 GPUs a server, 18 a rack, 36 a pod"
[gpu]
name = "H100 SXM 80GB"
peak_tflops = 989.0
memory_gb = 80.0
hbm_bw_gbps = 3350.0
[node]
gpus = 6
intra_bw_gbps = 450.0
[network]
nic_bw_gbps = 50.0
gpus_per_rack = 18
gpus_per_pod = 36
"""


def _placed_rank_by_rank(group, cluster):
    """Every group of the dimension placed member by member (ranks b + i·stride, b running over each
    block of size·stride ranks): how many lie inside one server, rack or pod or across pods, and the
    fewest members a group that spans servers has on one server."""
    blocks = {
        "nvlink": cluster.node.gpus,
        "rack": cluster.network.gpus_per_rack,
        "pod": cluster.network.gpus_per_pod,
    }
    counts: dict[str, int] = {}
    fewest = group.size
    for block_start in range(0, group.world, group.size * group.stride):
        for offset in range(group.stride):
            members = [block_start + offset + i * group.stride for i in range(group.size)]
            if group.size == 1:
                continue
            level = next(
                (
                    name
                    for name, block in blocks.items()
                    if len({member // block for member in members}) == 1
                ),
                "cross-pod",
            )
            counts[level] = counts.get(level, 0) + 1
            on_server = Counter(member // cluster.node.gpus for member in members)
            if len(on_server) > 1:
                fewest = min(fewest, *on_server.values())
    return counts, fewest


@pytest.mark.parametrize("profile", ["small", "six"])
def test_every_group_lands_where_placing_it_rank_by_rank_puts_it(small, tmp_path, profile):
    """Sizes and strides that are and are not powers of two, on 8- and 6-GPU servers, with up to 40
    groups (more than one period of first ranks) and strides past a pod."""
    cluster = small
    if profile == "six":
        path = tmp_path / "six.toml"
        path.write_text(SIX)
        cluster = load_cluster(str(path))
    for size in (2, 3, 4, 5, 8):
        for stride in (1, 2, 3, 4, 5, 6, 8, 10, 12, 24, 48):
            for groups in (1, 3, 40):
                group = Group(size, stride, size * stride * groups)
                counts, fewest = _placed_rank_by_rank(group, cluster)
                assert group_levels(group, cluster) == counts, group
                assert members_per_node(group, cluster) == fewest, group


def test_a_stride_past_a_pod_crosses_with_one_channel_a_group(small):
    """Stride 64 over a 32-GPU pod: each group has one member in each of two pods, so a pod's 32
    members cross on 32 channels; 32 NICs at 4:1 over them leave a quarter of a NIC each."""
    nic = 50e9 * 0.9
    assert group_bandwidth(Group(2, 64, 128), small)[0] == 32 * nic / 4 / 32


def test_the_uplinks_share_is_not_rounded_to_whole_bytes(tmp_path):
    """At 7:1, 0.85 of a 50 GB/s NIC, a stride of 10 (32 / 3 crossing channels): neither division
    gives a whole number of bytes/s."""
    path = tmp_path / "odd.toml"
    path.write_text(
        PROFILE.replace(
            "cross_pod_oversubscription = 4.0", "cross_pod_oversubscription = 7.0"
        ).replace("nic_efficiency = 0.9", "nic_efficiency = 0.85")
    )
    odd = load_cluster(str(path))
    nic = 50.0 * 1e9 * 0.85
    assert group_bandwidth(Group(4, 10, 40), odd)[0] == 32 * nic / 7.0 / (32 / 3)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            ("nic_bw_gbps = 50.0", 'nic_bw_gbps = "fast"'),
            "network.nic_bw_gbps = 'fast' must be of type float",
        ),
        (("sms = 132", 'sms = "many"'), "gpu.sms = 'many' must be of type int"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_type_its_field_takes(tmp_path, change, named):
    """A float field takes ints too, and names float; an optional field names its type, not None."""
    path = tmp_path / "bad.toml"
    path.write_text(PROFILE.replace(*change, 1))
    with pytest.raises(FourdError, match=re.escape(named)):
        load_cluster(str(path))


def test_a_profile_the_kernel_will_not_read_or_not_utf8_is_refused_in_one_line(tmp_path):
    """/proc/self/mem is a file every user may open, and reading it from its start fails (EIO)."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b'name = "\xff\xfe"\n')
    for path in (Path("/proc/self/mem"), binary):
        with pytest.raises(FourdError) as refused:
            load_cluster(str(path))
        assert str(refused.value).startswith(f"{path}: not a readable TOML profile (")
        assert "\n" not in str(refused.value)


def test_every_part_of_a_profile_is_an_immutable_value(small):
    sample = GemmSample(m=1, n=1, k=1, tflops=1.0)
    parts = [small, small.gpu, small.node, small.network, sample]
    parts += [AttentionSample(seq=1, head_dim=1, fwd_tflops=1.0, bwd_tflops=1.0)]
    parts += [CollectiveSample(op="all_reduce", nproc=2, alpha_s=0.0, beta_s_per_byte=0.0)]
    parts += [Group(2, 1, 2)]
    for part in parts:
        field = dataclasses.fields(part)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, field, None)
