"""What `fourd train` decides before launch and reports after: the GPU's preset, `--layout auto`, the
planner's --search result run as given, the memory check, FP8's refusal, a padded vocabulary, HFU beside
MFU, the prediction beside the measurement."""

import json
import re
import time

import pytest
import tomllib

from fourd.model.config import get_preset

# A `fourd calibrate`-shaped profile of a 2-core machine with 4 GB, so that the choices do not depend on this one.
LOCAL = "\n".join(
    [
        'name = "local"',
        'dtype = "fp32"',
        'gpu = {name = "CPU worker", peak_tflops = 0.1, memory_gb = 4.0, hbm_bw_gbps = 10.0, '
        "gemm = [{m = 1024, n = 1024, k = 1024, tflops = 0.05}]}",
        "node = {gpus = 8, intra_bw_gbps = 1.0, concurrent_ranks = 2}",
        "network = {nic_bw_gbps = 1.0}",
    ]
)


@pytest.fixture
def home(tmp_path):
    (tmp_path / "home" / "clusters").mkdir(parents=True)
    (tmp_path / "home" / "clusters" / "local.toml").write_text(LOCAL)
    return {"FOURD_HOME": str(tmp_path / "home")}


def rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_planners_search_result_runs_as_given_and_auto_chooses_it(fourd, tmp_path, home):
    code, out, err = fourd(
        "plan",
        "--model",
        "debug",
        "--cluster",
        "local",
        "--gpus",
        2,
        "--search",
        "--json",
        env=home,
        timeout=120,
    )
    assert code == 0, err
    best = json.loads(out)["best"]
    lay = ",".join(f"{d}={best['layout'][d]}" for d in ("tp", "cp", "pp", "dp"))
    flags = [
        f"--parallel.{k}={best[k]}"
        for k in ("schedule", "microbatches", "virtual_stages", "zero", "recompute")
    ] + [
        f"--parallel.sequence_parallel={best['sequence_parallel']}",
        f"--data.seq_len={best['seq']}",
    ]
    flags.append(f"--train.global_batch={best['global_batch_tokens'] // best['seq']}")
    code, out, err = fourd(
        "train",
        "--model",
        "debug",
        "--steps",
        2,
        "--layout",
        lay,
        *flags,
        "--run-dir",
        tmp_path / "given",
        env=home,
        timeout=300,
    )
    assert code == 0, err[-2000:]
    given = rows(tmp_path / "given")
    assert [r["step"] for r in given] == [1, 2]
    code, out, err = fourd(
        "train",
        "--model",
        "debug",
        "--steps",
        2,
        "--layout",
        "auto",
        "--run-dir",
        tmp_path / "auto",
        env=home,
        timeout=300,
    )
    assert code == 0, err[-2000:]
    chose = [line for line in out.splitlines() if "--layout auto" in line]
    assert len(chose) == 1 and f"local (2 devices): {lay}, {best['schedule']}" in chose[0], out
    assert f"ZeRO {best['zero']}, recompute {best['recompute']}" in chose[0]
    assert [r["loss"] for r in rows(tmp_path / "auto")] == [r["loss"] for r in given]
    # the run records what the planner chose, not `auto`: the whole parallel section is the given run's
    recorded = {
        name: tomllib.loads((tmp_path / name / "config.toml").read_text())["parallel"]
        for name in ("given", "auto")
    }
    assert recorded["auto"] == recorded["given"]
    # the summary puts the planner's figures beside the measured ones, with the error of each
    for label in ("tokens/s", "step time", "MFU", "peak memory"):
        (line,) = [x for x in out.splitlines() if x.startswith(label + "   ")]
        assert "; planner " in line and "%)" in line, line


@pytest.mark.slow
def test_a_model_too_big_for_this_machine_is_refused_in_seconds(fourd, tmp_path):
    start = time.monotonic()
    code, out, err = fourd(
        "train", "--model", "llama3-8b", "--steps", 1, "--run-dir", tmp_path / "r", timeout=60
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(
        "fourd: error: memory: llama3-8b at layout tp=1,cp=1,pp=1,dp=1 needs about 1"
    ), lines
    assert "GB" in lines[0] and "no layout of 1 device fits" in lines[0]
    assert time.monotonic() - start < 15
    assert not (tmp_path / "r").exists()


def test_the_memory_check_names_recomputation_a_smaller_batch_or_none():
    from fourd.config import Config, set_value
    from fourd.errors import FourdError
    from fourd.layout import Layout, Parallelism
    from fourd.plan.cluster import load_cluster
    from fourd.plan.request import rank_peak_memory_gb
    from fourd.train.auto import check_memory

    cfg = Config()
    for key, value in {
        "model.preset": "small",
        "data.seq_len": 1024,
        "train.global_batch": 16,
    }.items():
        set_value(cfg, key, value)
    gpu = load_cluster("llama3-h100")  # a GPU profile: the capacity is one rank's

    def need(recompute="none", seqs=16):
        return (
            rank_peak_memory_gb(
                get_preset("small"),
                gpu,
                Parallelism(layout=Layout(), recompute=recompute),
                1024,
                seqs,
            )
            * 1e9
        )

    assert need("full") < need("none") and need(seqs=1) < need("full")
    check_memory(cfg, gpu, int(need()) + 1)  # fits: no error
    for capacity, fix in [
        (
            (need() + need("full")) / 2,
            "recompute each layer in backward (--parallel.recompute=full)",
        ),
        (
            (need("full") + need(seqs=1)) / 2,
            "train on a smaller global batch (--train.global_batch=1)",
        ),
        (need(seqs=1) / 2, "no layout of 1 device fits: train a smaller model, or on more devices"),
    ]:
        with pytest.raises(FourdError) as e:
            check_memory(cfg, gpu, int(capacity))
        assert str(e.value) == (
            f"memory: small at layout tp=1,cp=1,pp=1,dp=1 needs about {need() / 1e9:.1f} GB, more than "
            f"{int(capacity) / 1e9:.1f} GB per GPU: {fix}"
        )


def test_a_gpu_plans_on_the_preset_its_cuda_name_holds():
    from fourd.plan.cluster import load_cluster
    from fourd.train.auto import gpu_preset

    # names torch.cuda.get_device_name reports; "NVIDIA GB200" also holds "B200"
    names = {
        "NVIDIA GB200": "dgx-gb200",
        "NVIDIA B200": "dgx-b200",
        "NVIDIA H200": "dgx-h200",
        "NVIDIA H100 80GB HBM3": "dgx-h100",
        "NVIDIA A100-SXM4-80GB": "selene-a100",
        "NVIDIA A800-SXM4-80GB": "dgx-a800",
        "NVIDIA H800": "hgx-h800",
        "NVIDIA L40S": "dgx-h100",
    }
    assert {name: gpu_preset(name) for name in names} == names
    b200 = load_cluster("dgx-b200").gpu
    assert (b200.name, b200.peak_tflops, b200.fp8_peak_tflops, b200.memory_gb) == (
        "B200 180GB",
        2250.0,
        4500.0,
        180.0,
    )
    # the export parts: their siblings' compute and memory, NVLink at 200 GB/s a direction where
    # the sibling's runs at 450 (H100) or 300 (A100)
    siblings = (("hgx-h800", "dgx-h100", 450.0), ("dgx-a800", "selene-a100", 300.0))
    for export, sibling, sibling_nvlink_gbps in siblings:
        part, full = load_cluster(export), load_cluster(sibling)
        assert (part.gpu.peak_tflops, part.gpu.memory_gb, part.gpu.gemm_efficiency) == (
            full.gpu.peak_tflops,
            full.gpu.memory_gb,
            full.gpu.gemm_efficiency,
        )
        assert part.node.intra_bw_gbps == 200.0
        assert full.node.intra_bw_gbps == sibling_nvlink_gbps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hfu_counts_full_recomputation(fourd, tmp_path):
    code, _, err = fourd(
        "train",
        "--model",
        "debug",
        "--steps",
        2,
        "--parallel.recompute=full",
        "--run-dir",
        tmp_path,
    )
    assert code == 0, err
    cfg = get_preset("debug")
    ratio = cfg.flops_per_token(256, "full") / cfg.flops_per_token(256)
    # 6·(N − E) + 12·L·H·Q·T, plus one more forward of every layer: 2·L·P_layer + 4·L·H·Q·T
    assert ratio == 1 + (2 * 4 * cfg.layer_params() + 4 * 4 * 64 * 256) / cfg.flops_per_token(256)
    for r in rows(tmp_path):
        assert r["hfu"] == pytest.approx(r["mfu"] * ratio, rel=1e-12)


@pytest.mark.slow
def test_fp8_is_refused_with_one_line_off_an_h100_or_h200(fourd, tmp_path):
    code, out, err = fourd(
        "train", "--model", "debug", "--steps", 1, "--train.fp8=true", "--run-dir", tmp_path / "r"
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines == [
        "fourd: error: train.fp8 needs a CUDA H100 or H200 training in bf16, found no CUDA device: drop train.fp8"
    ], err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_vocabulary_larger_than_the_tokenizers_is_padding_said_once(fourd, tmp_path):
    code, out, err = fourd(
        "train", "--model", "debug", "--model.vocab=384", "--steps", 2, "--run-dir", tmp_path
    )
    assert code == 0, err
    note = "fourd train: note: the model's vocabulary (384) is larger than the tokenizer's (256 ids); the other rows"
    assert [line for line in out.splitlines() if "note:" in line] == [
        note + " are padding, never a target"
    ]
    assert len(rows(tmp_path)) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_uncalibrated_machine_gets_the_planners_memory_and_one_line_naming_calibrate(
    fourd, tmp_path
):
    """A fresh FOURD_HOME has no `fourd calibrate` profile: no predicted time (it once read 225 %
    MFU), one line saying how to get it, and the peak memory predicted with the worker's baseline."""
    from fourd.config import fourd_home
    from fourd.train.auto import NOT_CALIBRATED

    cache = f"--data.cache_dir={fourd_home() / 'cache'}"  # the token cache is not the profile
    code, out, err = fourd(
        "train",
        "--model",
        "small",
        "--layout",
        "dp=2",
        "--steps",
        3,
        "--train.global_batch=4",
        cache,
        "--run-dir",
        tmp_path / "r",
        env={"FOURD_HOME": str(tmp_path / "home")},
        timeout=600,
    )
    assert code == 0, err[-2000:]
    summary = {line.split("   ")[0]: line for line in out.splitlines() if "   " in line}
    for label in ("tokens/s", "step time", "MFU"):
        assert "planner" not in summary[label], summary[label]
    assert summary["planner"] == f"planner       {NOT_CALIBRATED}"
    memory = re.fullmatch(
        r"peak memory   (\d\.\d\d) GB per rank; planner (\d\.\d\d) GB \(([+-]\d+)%\)",
        summary["peak memory"],
    )
    assert memory, summary["peak memory"]
    measured, predicted = float(memory[1]), float(memory[2])
    assert abs(predicted / measured - 1) <= 0.25, summary["peak memory"]


def test_the_planners_memory_is_set_beside_training_before_the_first_checkpoint_save():
    """A checkpoint save holds memory of its own (0.19 GB a rank at `make run`), which the planner's
    training peak leaves out: the error is against the peak before the first save."""
    from fourd.train.metrics import summary_table

    rows = [
        {"step": s, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0, "mfu": 0.1}
        | {"peak_mem_gb": gb}
        for s, gb in ((1, 0.40), (2, 0.48), (3, 0.66), (4, 0.69))
    ]
    predicted = {"peak_mem_gb": 0.36}
    (line,) = [x for x in summary_table(rows, {}, predicted, 2).splitlines() if "memory" in x]
    assert line == (
        "peak memory   0.69 GB per rank (0.48 GB before the first checkpoint save); "
        "planner 0.36 GB (-25%)"
    )
    (line,) = [x for x in summary_table(rows, {}, predicted).splitlines() if "memory" in x]
    assert line == "peak memory   0.69 GB per rank; planner 0.36 GB (-48%)"


def test_the_planners_figures_beside_a_cpu_run_share_one_peak_and_count_rank_0s_memory(
    tmp_path, monkeypatch
):
    """On a calibrated CPU profile: tokens/s is the global batch's tokens over the planned step, MFU the
    trainer's FLOPs over the step and the one peak the ranks share (not one a rank), and the peak memory rank
    0's tensors and runtime reserve (the baseline given) in GiB."""
    from fourd.config import Config, model_config, parallelism, set_value
    from fourd.plan.job import Job
    from fourd.plan.memory import rank_memories
    from fourd.plan.search import evaluate
    from fourd.train.auto import machine, predict

    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "local.toml").write_text(LOCAL)
    monkeypatch.setenv("FOURD_HOME", str(tmp_path))
    cfg = Config()
    for key, value in {
        "model.preset": "debug",
        "parallel.layout": "dp=2",
        "train.compile": False,
    }.items():
        set_value(cfg, key, value)
    got = predict(cfg, 2e11, 2, "cpu", 3e8)
    cluster = machine(cfg, 3e8)[0]
    job = Job(
        model_config(cfg), cluster, parallelism(cfg), cfg.data.seq_len, cfg.train.global_batch
    )
    step = evaluate(job).step.step_s
    tokens = cfg.train.global_batch * cfg.data.seq_len
    assert got["step_time_s"] == step
    assert got["tokens_per_s"] == tokens / step
    assert got["mfu"] == pytest.approx(
        model_config(cfg).flops_per_token(cfg.data.seq_len) * tokens / step / 2e11, rel=1e-12
    )
    rank0 = rank_memories(job, [0])[0]
    assert rank0.reserve == 3e8
    assert got["peak_mem_gb"] == pytest.approx((rank0.total + 3e8) / 2**30, rel=1e-12)


def test_layout_auto_sets_every_setting_of_the_planners_best_plan(tmp_path, monkeypatch, capsys):
    """`--layout auto` in one process: the layout and every parallel setting the planner chose (its
    fastest plan that fits), and one line saying so."""
    from fourd.config import Config, model_config, set_value
    from fourd.plan.cluster import load_cluster
    from fourd.plan.request import best_plan
    from fourd.train.auto import choose

    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "local.toml").write_text(LOCAL)
    monkeypatch.setenv("FOURD_HOME", str(tmp_path))
    cluster = load_cluster("local")
    cfg = Config()
    for key, value in {"model.preset": "debug", "parallel.layout": "auto"}.items():
        set_value(cfg, key, value)
    best = best_plan(model_config(cfg), cluster, 2, cfg.data.seq_len, cfg.train.global_batch).config
    choose(cfg, cluster, 2)
    assert cfg.parallel.layout == str(best.layout)
    for key in (
        "schedule",
        "microbatches",
        "virtual_stages",
        "zero",
        "recompute",
        "sequence_parallel",
    ):
        assert getattr(cfg.parallel, key) == getattr(best, key), key
    assert cfg.parallel.hsdp_replicas == best.hsdp_replicas
    assert cfg.parallel.zero != Config().parallel.zero  # the planner's stage, not the default's
    assert capsys.readouterr().out.startswith(
        f"fourd train: --layout auto on local (2 devices): {best.layout}, "
    )
