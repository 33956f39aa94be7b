"""Mixtures of prepared datasets: exact shares per block, samples from (seed, index) alone,
`fourd train --data.mix` resumed bit for bit and equal at tp=2,dp=2 to one process, recorded with
absolute paths, and `fourd generate --eval-holdout` scoring the held-out windows the run scored."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_fourd

from fourd.cli import main
from fourd.config import load_toml
from fourd.data.dataset import MIX_BLOCK, Mixture, TokenDataset, absolute_mix, open_prepared
from fourd.data.prepare import Request, prepare_into
from fourd.data.sources import list_sources
from fourd.errors import FourdError


def positions(tmp_path, name, count, offset):
    """A dataset whose token at position i is offset + i: a sample shows where it was read."""
    path = tmp_path / f"{name}.bin"
    np.arange(offset, offset + count, dtype=np.uint32).tofile(path)
    return TokenDataset(
        path=path, tokens=count, vocab_size=offset + count, dtype="uint32", source=name
    )


def test_each_block_holds_each_datasets_exact_share_in_an_order_from_the_seed(tmp_path):
    small, large = positions(tmp_path, "a", 5000, 0), positions(tmp_path, "b", 9000, 100_000)
    mix = Mixture(parts=(small, large), weights=(0.7, 0.3), spec="a=0.7,b=0.3")
    stream = mix.stream(8, seed=5, holdout_fraction=0.0)
    firsts = np.array([int(stream.sample(i)[0]) for i in range(2 * MIX_BLOCK)])
    from_a = firsts < 100_000
    assert from_a[:MIX_BLOCK].sum() == from_a[MIX_BLOCK:].sum() == 2867  # 0.7 · 4096, rounded
    # dataset a's samples, in order, are its own stream's samples 0, 1, 2, ...
    own = small.stream(8, seed=5, holdout_fraction=0.0)
    assert firsts[from_a].tolist() == [int(own.sample(k)[0]) for k in range(2 * 2867)]
    again = mix.stream(8, seed=5, holdout_fraction=0.0)
    assert np.array_equal(again.samples(4000, 16), stream.samples(4000, 16))  # any index, any order
    other = mix.stream(8, seed=6, holdout_fraction=0.0)
    assert not np.array_equal(other.samples(0, 64), stream.samples(0, 64))


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """Two prepared byte-level datasets of different text, as `--data.mix A=0.7,B=0.3`."""
    folder = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    spec = []
    for name, words, weight in (("a", ["ring", "rank", "sends"], 0.7), ("b", ["xyz", "q"], 0.3)):
        docs = [" ".join(rng.choice(words, size=80)) for _ in range(60)]
        src = folder / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        request = Request(sources=tuple(list_sources([str(src)])), tokenizer="byte", label=name)
        prepare_into(request, folder / name)
        spec.append(f"{folder / name}={weight}")
    assert open_prepared(folder / "a").tokens > 20_000
    return ",".join(spec)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl") if line.strip()]


def common(spec):
    return ("--model", "debug", "--data.mix", spec, "--data.seq_len=32", "--train.global_batch=4")


@pytest.fixture(scope="module")
def reference(mix, tmp_path_factory):
    """Three steps on the mixture in one process: the losses the other runs must give."""
    whole = tmp_path_factory.mktemp("whole")
    code, _, err = run_fourd("train", *common(mix), "--steps", 3, "--run-dir", whole, timeout=500)
    assert code == 0, err
    return losses(whole)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_mixture_run_resumed_continues_bit_for_bit(mix, reference, tmp_path):
    halves = tmp_path / "halves"
    code, _, err = run_fourd("train", *common(mix), "--steps", 2, "--run-dir", halves, timeout=500)
    assert code == 0, err
    code, out, err = run_fourd("train", "--resume", halves, "--steps", 3, timeout=500)
    assert code == 0, err
    assert "resuming from checkpoint" in out
    assert losses(halves) == reference  # bit for bit


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_mixture_at_tp2_dp2_gives_the_losses_of_one_process(mix, reference, tmp_path):
    argv = ("train", *common(mix), "--steps", 3, "--layout", "tp=2,dp=2", "--run-dir", tmp_path)
    code, _, err = run_fourd(*argv, timeout=800)
    assert code == 0, err[-2000:]
    assert len(reference) == 3
    assert max(abs(x - y) / abs(x) for x, y in zip(losses(tmp_path), reference)) < 1e-5


def test_a_mix_made_absolute_keeps_its_weights_as_written_and_its_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    here = tmp_path.resolve()
    spec = "web=0.70, ~/code=3e-1,../a=b=2"
    absolute = f"{here}/web=0.70,{here}/home/code=3e-1,{here.parent}/a=b=2"
    assert absolute_mix(spec) == absolute
    assert absolute_mix(absolute) == absolute
    with pytest.raises(FourdError) as e:
        absolute_mix("web=0.7,code")
    assert str(e.value) == (
        "data.mix item 'code' is not DIR=WEIGHT: give e.g. data/a=0.7,data/b=0.3"
    )


def folder_of(spec):
    """The folder the `mix` fixture prepared its datasets a and b in."""
    return Path(spec.split(",")[0].rpartition("=")[0]).parent


RELATIVE = "a=0.70,b=0.3"  # the `mix` fixture's datasets named from their folder, 0.7 as 0.70


@pytest.fixture(scope="module")
def relative_run(mix, tmp_path_factory):
    """Two steps on the mixture named by relative paths, the held-out loss evaluated at each step
    over one global batch of held-out windows."""
    run = tmp_path_factory.mktemp("relative") / "run"
    argv = ("train", *common(RELATIVE), "--steps", 2, "--eval.every", 1, "--eval.batches", 1)
    code, _, err = run_fourd(*argv, "--run-dir", run, cwd=folder_of(mix), timeout=500)
    assert code == 0, err
    return run


def absolute_spec(mix):
    folder = folder_of(mix).resolve()
    return f"{folder / 'a'}=0.70,{folder / 'b'}=0.3"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_relative_data_mix_is_recorded_with_absolute_paths(mix, relative_run):
    config = load_toml(relative_run / "config.toml")
    assert config["data"]["mix"] == absolute_spec(mix)
    manifest = json.loads((relative_run / "checkpoints/step-2/manifest.json").read_text())
    assert manifest["train"]["config"]["data"]["mix"] == absolute_spec(mix)
    assert manifest["train"]["data"]["path"] == absolute_spec(mix)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_relative_mixture_run_resumes_from_another_directory(relative_run, reference, tmp_path):
    run = shutil.copytree(relative_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, out, err = run_fourd("train", "--resume", run, "--steps", 3, cwd=elsewhere, timeout=500)
    assert code == 0, err
    assert "resuming from checkpoint" in out
    assert losses(run) == reference  # bit for bit


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_that_recorded_a_relative_mix_resumes_from_its_directory(
    mix, relative_run, reference, tmp_path
):
    """As runs of fourd before data.mix was made absolute recorded it: the same datasets."""
    run = shutil.copytree(relative_run, tmp_path / "run")
    config = run / "config.toml"
    config.write_text(config.read_text().replace(absolute_spec(mix), RELATIVE))
    assert f'mix = "{RELATIVE}"' in config.read_text()
    code, _, err = run_fourd(
        "train", "--resume", run, "--steps", 3, cwd=folder_of(mix), timeout=500
    )
    assert code == 0, err
    assert losses(run) == reference
    assert load_toml(config)["data"]["mix"] == absolute_spec(mix)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_holdout_of_a_mixture_run_gives_the_held_out_loss_it_logged(
    mix, relative_run, tmp_path, monkeypatch, capsys
):
    from fourd.hf.inference import load_model, perplexity

    monkeypatch.chdir(tmp_path)  # no dataset here: the run's record names them
    step = relative_run / "checkpoints/step-2"
    window = 4 * 32 + 1  # the run's eval.batches 1: global_batch 4 windows of data.seq_len 32
    argv = ["generate", "--ckpt", str(step), "--eval-holdout", "--eval-tokens", str(window)]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    logged = [json.loads(line) for line in open(relative_run / "metrics.jsonl")]
    assert logged[1]["step"] == 2
    assert got["tokens"] == window - 1
    assert got["nll_per_token"] == pytest.approx(logged[1]["val_loss"], rel=1e-6, abs=0)
    # a mixture's held-out windows are its first dataset's held-out tail (data.holdout_fraction 0.01)
    first = open_prepared(folder_of(mix) / "a")
    start = first.held_out_start(0.01)
    model, _ = load_model(step)
    assert got == perplexity(model, first.read(start, start + window).tolist(), 32)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_holdout_of_a_mixture_run_refuses_another_corpus(
    mix, relative_run, monkeypatch, capsys
):
    monkeypatch.chdir(folder_of(mix))
    step = str(relative_run / "checkpoints/step-2")
    capsys.readouterr()
    assert main(["generate", "--ckpt", step, "--eval-holdout", "a"]) == 2
    where = folder_of(mix).resolve()
    assert capsys.readouterr().err.splitlines() == [
        f"fourd: error: --eval-holdout '{where / 'a'}' differs from the run's "
        f"'{absolute_spec(mix)}'; leave --eval-holdout out to use the run's"
    ]
    argv = ["generate", "--ckpt", step, "--eval-holdout", RELATIVE, "--eval-tokens", "129"]
    assert main([*argv, "--json"]) == 0  # the run's own mixture, named from here: no contradiction
    assert json.loads(capsys.readouterr().out)["tokens"] == 128
