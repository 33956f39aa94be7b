"""`fourd plan` as a user runs it: a real process, real profile files, JSON and the readable report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fourd.model.config import get_preset

ROW1 = [
    "--model",
    "llama3-405b",
    "--cluster",
    "llama3-h100",
    "--gpus",
    "8192",
    "--layout",
    "tp=8,pp=16,dp=64",
    "--seq",
    "8192",
    "--global-batch-tokens",
    "16777216",
    "--schedule",
    "interleaved",
]

# Runs the CLI in a fresh interpreter and reports whether torch got imported on the way.
_RUNNER = """
import sys
from fourd.cli import main
code = main(sys.argv[1:])
print("TORCH_LOADED" if "torch" in sys.modules else "NO_TORCH", file=sys.stderr)
sys.exit(code)
"""


def plan(*args, home=None):
    env = dict(os.environ, FOURD_HOME=str(home or "/nonexistent-fourd-home"))
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_json_plan_has_the_documented_keys_and_never_imports_torch():
    r = plan(*ROW1, "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().endswith("NO_TORCH")
    d = json.loads(r.stdout)
    assert d["layout"] == {"tp": 8, "cp": 1, "pp": 16, "dp": 64}
    assert d["schedule"] == "interleaved" and d["microbatches"] == 32 and d["virtual_stages"] == 8
    assert set(d["memory_gb"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert d["fits"] is True
    for key in (
        "step_time_s",
        "tokens_per_s",
        "tflops_per_gpu",
        "hw_tflops_per_gpu",
        "mfu",
        "bubble_fraction",
    ):
        assert isinstance(d[key], float)
    assert abs(d["mfu"] - 0.43) <= 0.02
    assert d["tokens_per_s"] == pytest.approx(16777216 / d["step_time_s"])
    assert d["mfu"] == pytest.approx(d["tflops_per_gpu"] / 989.0)
    assert d["placement"] == {"tp": "nvlink", "cp": "single", "pp": "pod", "dp": "cross-pod"}
    assert d["chosen_by_planner"] == [
        "virtual stages",
        "microbatches",
        "zero",
        "recompute",
        "compile",
    ]


def test_training_days_from_a_token_budget():
    d = json.loads(plan(*ROW1, "--train-tokens", "15.6T", "--json").stdout)
    assert d["training_days"] == pytest.approx(15.6e12 / d["tokens_per_s"] / 86400)


def test_readable_report_explains_the_drop_from_43_to_41():
    args = [a if a != "tp=8,pp=16,dp=64" else "tp=8,pp=16,dp=128" for a in ROW1]
    args[args.index("8192")] = "16384"
    r = plan(*args)
    assert r.returncode == 0, r.stderr
    assert "16 sequences, so 16 microbatches" in r.stdout
    assert "With half the replicas (dp=64, 32 sequences and 32 microbatches each" in r.stdout
    assert "NVLink, inside one server" in r.stdout and "fits" in r.stdout


def test_small_models_and_single_microbatches_read_right():
    r = plan(
        "--model",
        "debug",
        "--cluster",
        "dgx-h100",
        "--layout",
        "pp=2",
        "--microbatches",
        "1",
        "--seq",
        "256",
        "--global-batch-tokens",
        "512",
        "--pipeline-comm",
        "blocking",
    )
    assert r.returncode == 0, r.stderr
    n = get_preset("debug").params()
    assert (
        f"model with {n / 1e3:.3g}K parameters" in r.stdout
        and " · 1 microbatch of 2 × 256 tokens · " in r.stdout
    )
    assert "each replica gets 2 sequences, so 1 microbatch;" in r.stdout


def test_search_json_best_and_candidates():
    r = plan(
        "--model",
        "llama3-405b",
        "--cluster",
        "llama3-h100",
        "--gpus",
        "16384",
        "--seq",
        "8192",
        "--global-batch-tokens",
        "16777216",
        "--search",
        "--json",
        "--top",
        "5",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["best"]["mfu"] >= 0.41 and d["best"]["fits"]
    assert d["best"] == d["candidates"][0] and len(d["candidates"]) == 5
    rates = [c["tokens_per_s"] for c in d["candidates"]]
    assert rates == sorted(rates, reverse=True)
    # each candidate's figures are those of its own configuration, evaluated alone
    from fourd.layout import Layout, Parallelism
    from fourd.plan.cluster import load_cluster
    from fourd.plan.job import Job
    from fourd.plan.search import evaluate

    h100 = load_cluster("llama3-h100")
    for c in d["candidates"]:
        keys = (
            "schedule",
            "microbatches",
            "virtual_stages",
            "zero",
            "recompute",
            "sequence_parallel",
        )
        par = Parallelism(layout=Layout(**c["layout"]), **{k: c[k] for k in keys})
        job = Job(get_preset("llama3-405b"), h100, par, 8192, 2048, compiled=c["compiled"])
        assert c["step_time_s"] == evaluate(job).step.step_s and par.layout.world == 16384


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--layout", "tp=3,dp=2"],
            "tp=3 cannot cut the model's heads (128), KV heads (8), FFN width (53248)",
        ),
        (
            ["--layout", "tp=8,pp=16,dp=64", "--gpus", "100"],
            "make the product of the degrees equal 100",
        ),
        (
            ["--layout", "tp=8,pp=16,dp=64", "--global-batch-tokens", "1000"],
            "a global batch of 1000 tokens is not a whole number of 8192-token sequences: use a multiple of 8192",
        ),
        (
            ["--gpus", "64", "--microbatches", "7"],
            "no configuration of 64 GPUs runs this model with 8192-token sequences and 2048 sequences per step in 7 "
            "microbatches per replica: change the number of GPUs, the sequence length, the microbatches or the global batch",
        ),
        (["--cluster", "nowhere"], "unknown cluster 'nowhere':"),
        (["--cluster", "dgx-h10"], "unknown cluster 'dgx-h10' (did you mean `dgx-h100`?)"),
        (
            ["--gpus", "8", "--pipeline-comm", "async"],
            "argument --pipeline-comm: 'async': choose one of overlapped",
        ),
        (["--cluster", "local"], "run `fourd calibrate` to write it"),
        (
            ["--gpus", "8", "--seq", "0"],
            "argument --seq: 0 is out of range: give a sequence length from 2 to 16,777,216",
        ),
        (
            ["--gpus", "8", "--microbatches", "0"],
            "argument --microbatches: 0 is out of range: give a whole number from 1",
        ),
        (
            ["--gpus", "8", "--virtual-stages", "0"],
            "argument --virtual-stages: 0 is out of range: give a whole number from 1",
        ),
        (
            ["--gpus", "8", "--top", "-1"],
            "argument --top: -1 is out of range: give a whole number from 1 to 10,000",
        ),
        (
            ["--gpus", "8", "--train-tokens=-5T"],
            "argument --train-tokens: '-5T' must be a positive finite count",
        ),
        (
            ["--gpus", "8", "--global-batch-tokens", "nan"],
            "argument --global-batch-tokens: 'nan' must be a positive",
        ),
        (["--gpus", "nan"], "argument --gpus: 'nan' is not a whole number"),
        (
            ["--gpus", "8", "--sequence-parallel", "yes"],
            "argument --sequence-parallel: 'yes': choose on or off",
        ),
        (
            ["--gpus", "8", "--schedule", "1f1b", "--virtual-stages", "2"],
            "2 virtual stages need the interleaved schedule (1f1b runs one stage per rank): choose the interleaved "
            "schedule or one virtual stage",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = plan("--model", "llama3-405b", "--seq", "8192", *args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln not in ("NO_TORCH", "TORCH_LOADED")]
    assert len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.parametrize(
    "spec,needle",
    [
        (
            "layers=2,dim=64,ffn=128,heads=0,vocab=256",
            "--model-spec: heads=0 must be a positive integer",
        ),
        (
            "layers=2,dim=64,ffn=128,heads=4,heads=8,vocab=256",
            "--model-spec: heads is given twice; give each key once",
        ),
        ("layers=2,dim=64,ffn=128,heads=4", "--model-spec lacks vocab"),
        ("layers=2,dim=64,ffn=128,heads=4,vocab=256,depth=3", "--model-spec: bad item 'depth=3'"),
    ],
)
def test_bad_model_spec_is_one_line(spec, needle):
    r = plan("--model-spec", spec, "--gpus", "1")
    lines = [ln for ln in r.stderr.splitlines() if ln not in ("NO_TORCH", "TORCH_LOADED")]
    assert (
        r.returncode == 2 and len(lines) == 1 and lines[0].startswith("fourd: error: --model-spec")
    )
    assert needle in lines[0]


def test_any_gpu_count_on_a_preset_and_interleaving_with_fewer_microbatches_than_stages():
    # a profile describes a server, a pod and the network, not a size: 6,144 GPUs are six pods of dgx-h100
    r = plan(
        "--model",
        "llama3-405b",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "6144",
        "--layout",
        "tp=8,pp=8,dp=96",
        "--seq",
        "8192",
        "--global-batch-tokens",
        str(2016 * 8192),
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["placement"]["dp"] == "cross-pod"
    # 8 microbatches on 16 pipeline ranks: each of the V rounds waits for microbatch 0 to come round
    # (the closed form at the slowest rank's pace, less what fill and drain save through the lighter
    # first and last ranks: fourd.plan.perf.fill_and_drain_saving)
    from fourd.plan import request
    from fourd.plan.cluster import load_cluster
    from fourd.plan.perf import fill_and_drain_saving

    d = json.loads(plan(*ROW1, "--microbatches", "8", "--json").stdout)
    assert (d["microbatches"], d["virtual_stages"]) == (8, 8)
    compute, bubble = d["breakdown_s"]["compute"], d["breakdown_s"]["bubble"]
    values = {"gpus": 8192, "layout": "tp=8,pp=16,dp=64", "seq": 8192}
    values |= {"global_batch_tokens": "16777216", "microbatches": 8}
    cluster = load_cluster("llama3-h100")
    found = request.plans(request.resolve(get_preset("llama3-405b"), cluster, values), top=1)
    saving = fill_and_drain_saving(found[0].job)
    assert 0 < saving < 0.05 * bubble
    assert (bubble + saving) / compute == pytest.approx((15 * 8 - 7 * 7) / (8 * 8), rel=1e-9)


def test_user_profile_wins_over_the_preset_and_paths_work(tmp_path):
    from fourd.layout import Layout, Parallelism
    from fourd.plan.cluster import load_cluster
    from fourd.plan.job import Job
    from fourd.plan.search import evaluate

    preset = (
        Path(__file__).resolve().parents[1] / "fourd" / "plan" / "clusters" / "llama3-h100.toml"
    )
    (tmp_path / "clusters").mkdir()
    # the same cluster with twice the peak: a user profile of that name must change the prediction
    faster = preset.read_text().replace("peak_tflops = 989.0", "peak_tflops = 1978.0")
    (tmp_path / "clusters" / "llama3-h100.toml").write_text(faster)
    base = json.loads(plan(*ROW1, "--json").stdout)
    mine = json.loads(plan(*ROW1, "--json", home=tmp_path).stdout)
    path = tmp_path / "elsewhere.toml"
    path.write_text(faster)
    par = Parallelism(
        layout=Layout(8, 1, 16, 64),
        schedule="interleaved",
        microbatches=base["microbatches"],
        virtual_stages=base["virtual_stages"],
        zero=base["zero"],
        recompute=base["recompute"],
        sequence_parallel=True,
    )
    want = evaluate(
        Job(get_preset("llama3-405b"), load_cluster(str(path)), par, 8192, 2048, compiled=True)
    ).step.step_s
    assert (mine["microbatches"], mine["virtual_stages"], mine["zero"], mine["recompute"]) == (
        32,
        8,
        1,
        "selective",
    )
    assert mine["step_time_s"] == want and base["step_time_s"] != want
    args = [a if a != "llama3-h100" else str(path) for a in ROW1]
    assert json.loads(plan(*args, "--json").stdout)["step_time_s"] == want


def test_a_broken_profile_names_the_key(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[gpu]\nname = 'x'\npeak_tflop = 1.0\n[node]\ngpus = 1\n[network]\n")
    r = plan("--model", "debug", "--cluster", str(path), "--gpus", "1")
    assert r.returncode == 2 and "unknown key(s) peak_tflop in [gpu]" in r.stderr


def test_cpu_profile_in_fp32(tmp_path):
    path = tmp_path / "cpu.toml"
    path.write_text("""
name = "cpu"
dtype = "fp32"
[gpu]
name = "CPU"
peak_tflops = 0.05
memory_gb = 16.0
hbm_bw_gbps = 10.0
[[gpu.gemm]]
m = 256
n = 256
k = 256
tflops = 0.02
[[gpu.gemm]]
m = 1024
n = 1024
k = 1024
tflops = 0.05
[node]
gpus = 8
intra_bw_gbps = 1.0
concurrent_ranks = 2
[network]
nic_bw_gbps = 1.0
[[collectives]]
op = "all_reduce"
nproc = 2
alpha_s = 1e-4
beta_s_per_byte = 1e-9
""")
    d = json.loads(
        plan(
            "--model",
            "small",
            "--cluster",
            str(path),
            "--layout",
            "dp=2",
            "--seq",
            "256",
            "--global-batch-tokens",
            "4096",
            "--zero",
            "0",
            "--json",
        ).stdout
    )
    params = get_preset("small").params()
    assert d["dtype"] == "fp32"
    assert d["memory_gb"]["params"] == pytest.approx(4 * params / 1e9, abs=1e-3)
    assert d["memory_gb"]["optimizer"] == pytest.approx(8 * params / 1e9, abs=1e-3)
    bf16 = json.loads(
        plan(
            "--model",
            "small",
            "--cluster",
            str(path),
            "--layout",
            "dp=2",
            "--seq",
            "256",
            "--global-batch-tokens",
            "4096",
            "--zero",
            "0",
            "--dtype",
            "bf16",
            "--json",
        ).stdout
    )
    assert bf16["memory_gb"]["params"] == pytest.approx(2 * params / 1e9, abs=1e-3)


def test_a_cpu_profile_defaults_to_what_fourd_train_runs(tmp_path):
    from fourd.config import DataSection, TrainSection

    path = tmp_path / "cpu.toml"
    path.write_text(
        'dtype = "fp32"\n[gpu]\nname = "CPU"\npeak_tflops = 0.05\nmemory_gb = 16.0\nhbm_bw_gbps = 10.0\n'
        "[node]\ngpus = 8\nintra_bw_gbps = 1.0\nconcurrent_ranks = 2\n[network]\nnic_bw_gbps = 1.0\n"
    )
    d = json.loads(
        plan("--model", "small", "--cluster", str(path), "--layout", "tp=2", "--json").stdout
    )
    assert d["seq"] == DataSection().seq_len
    assert d["global_batch_tokens"] == TrainSection().global_batch * DataSection().seq_len
    assert d["sequence_parallel"] is False and d["dtype"] == "fp32"
    gpu = json.loads(plan("--model", "small", "--layout", "tp=2", "--json").stdout)
    assert (gpu["seq"], gpu["global_batch_tokens"], gpu["sequence_parallel"]) == (1024, 2**24, True)


def test_a_gpt_block_by_model_spec():
    spec = "layers=96,dim=12288,ffn=49152,heads=96,vocab=51200,mlp=gelu"
    r = plan(
        "--model-spec",
        spec,
        "--cluster",
        "selene-a100",
        "--layout",
        "tp=8,pp=16,dp=8",
        "--seq",
        "2048",
        "--global-batch-tokens",
        "3M",
        "--schedule",
        "1f1b",
        "--zero",
        "0",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["mlp"] == "gelu" and d["model"]["kv_heads"] == 96
    # GPT-3 175B: 96 layers of 12·h² weights (and the norms' weights and biases) in 16 stages, the trainer's
    # split: embedding and output count as a layer each, the 2 left over fill the first and last stage
    assert d["stage_layers"] == [6] * 16
    layer = 4 * 12288**2 + 2 * 12288 * 49152 + 4 * 12288
    # the fullest GPU is pipeline rank 0: 6 layers and the input embedding, BF16 weights cut by TP
    assert d["memory_gb"]["params"] == pytest.approx(
        (6 * layer + 51200 * 12288) / 8 * 2 / 1e9, abs=1e-3
    )
    assert 0 < d["mfu"] < 1


def test_a_tied_gpt_by_model_spec_holds_its_embedding_once():
    """GPT-2 small's shape with tied=1 on one GPU: the weights count the vocabulary's matrix once,
    50,304 · 768 parameters fewer than untied (FP32, 4 B a parameter: fourd's stack computes by
    autocast over FP32 weights on one GPU)."""
    spec = "layers=12,dim=768,ffn=3072,heads=12,vocab=50304,mlp=gelu"
    results = {}
    for tied in ("0", "1"):
        r = plan(
            "--model-spec",
            f"{spec},tied={tied}",
            "--cluster",
            "dgx-h100",
            "--layout",
            "dp=1",
            "--seq",
            "1024",
            "--global-batch-tokens",
            "8192",
            "--json",
        )
        assert r.returncode == 0, r.stderr
        results[tied] = json.loads(r.stdout)
    assert results["1"]["model"]["tied_embeddings"] is True
    assert results["0"]["model"]["tied_embeddings"] is False
    fewer = results["0"]["memory_gb"]["params"] - results["1"]["memory_gb"]["params"]
    assert fewer == pytest.approx(50304 * 768 * 4 / 1e9, abs=1e-3)
    assert results["1"]["step_time_s"] < results["0"]["step_time_s"]  # a smaller optimizer step
