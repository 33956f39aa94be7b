"""Generation with a KV cache, sampling, perplexity, and the `fourd generate` command."""

import base64
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fourd.ckpt import store
from fourd.cli import main
from fourd.hf.inference import Cached, generate, load_model, nucleus, perplexity, sample
from fourd.model.config import get_preset
from fourd.model.llama import build_model

CFG = get_preset("debug")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_FILES = ("argparse.py", "dataclasses.py", "enum.py", "functools.py")
HELD_OUT = STDLIB / "textwrap.py"


def greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The debug model after 60 AdamW steps on a few standard-library modules, saved as a checkpoint."""
    torch.manual_seed(0)
    text = "".join((STDLIB / f).read_text() for f in TRAIN_FILES)
    data = torch.tensor(list(text.encode()), dtype=torch.long)
    model = build_model(CFG, seed=0)
    untrained = perplexity(model.eval(), list(HELD_OUT.read_bytes()), 256)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(60):
        starts = torch.randint(0, len(data) - 129, (16,), generator=gen)
        x = torch.stack([data[s : s + 129] for s in starts])
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    d = tmp_path_factory.mktemp("trained") / "step-60"
    store.save_model_checkpoint(d, CFG, model.state_dict(), step=60)
    return d, untrained


def test_kv_cache_logits_match_full_forward():
    model = build_model(CFG, seed=1).eval()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, first = model(ids), model(ids[:, :10])
        with Cached(model) as cache:
            prefill = cache.step(ids[0, :10].tolist())
            steps = [cache.step([int(t)]) for t in ids[0, 10:20]]
            chunk = cache.step(ids[0, 20:].tolist())  # several new tokens at once: the masked path
    assert torch.equal(prefill, first)  # the prompt goes through the model's own attention
    got = torch.cat([prefill, *steps, chunk], dim=1)
    assert (got - full).abs().max().item() <= 1e-5
    assert type(model.layers["0"].attention.core).__name__ == "CausalAttention"  # restored
    assert torch.equal(model(ids), full)


@pytest.mark.slow
def test_cached_greedy_equals_recomputing(trained):
    model, _ = load_model(trained[0])
    prompt = list(b"def __init__(self")
    assert generate(model, prompt, 30, greedy=True) == greedy_without_cache(model, prompt, 30)


def test_sampling_is_seeded_and_stays_in_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = [sample(logits, False, 0.7, 1.0, torch.Generator().manual_seed(s)) for s in range(300)]
    assert set(draws) == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 lie outside
    assert draws == [
        sample(logits, False, 0.7, 1.0, torch.Generator().manual_seed(s)) for s in range(300)
    ]
    assert {
        sample(logits, False, 1.0, 1.0, torch.Generator().manual_seed(s)) for s in range(300)
    } == {0, 1, 2, 3}
    assert {
        sample(logits, False, 0.01, 1.0, torch.Generator().manual_seed(s)) for s in range(50)
    } == {0}


def test_the_nucleus_is_softmax_of_the_logits_over_the_temperature():
    """p ∝ exp(logit / T): logits ln 1, ln 3, ln 6 give 1 : 3 : 6 at T = 1, 1 : 9 : 36 at T = 0.5 and
    1 : √3 : √6 at T = 2; the nucleus keeps a token while the mass before it is short of top_p."""
    logits = torch.log(torch.tensor([1.0, 3.0, 6.0]))
    cases = {
        (1.0, 1.0): ([2, 1, 0], [0.6, 0.3, 0.1]),
        (0.5, 1.0): ([2, 1, 0], [36 / 46, 9 / 46, 1 / 46]),
        (2.0, 1.0): ([2, 1, 0], [v / (1 + 3**0.5 + 6**0.5) for v in (6**0.5, 3**0.5, 1)]),
        # the mass before tokens 2, 1, 0: 0, 0.6, 0.9 at T = 1; 0, 0.78, 0.98 at T = 0.5
        (1.0, 0.7): ([2, 1], [6 / 9, 3 / 9]),
        (0.5, 0.7): ([2], [1.0]),
        (2.0, 0.7): ([2, 1], [6**0.5 / (6**0.5 + 3**0.5), 3**0.5 / (6**0.5 + 3**0.5)]),
    }
    for (temperature, top_p), (ids, probs) in cases.items():
        got_ids, got_probs = nucleus(logits, top_p, temperature)
        assert got_ids.tolist() == ids, (temperature, top_p)
        assert got_probs.tolist() == pytest.approx(probs, rel=1e-6), (temperature, top_p)


@pytest.mark.slow
def test_tiny_top_p_is_greedy(trained):
    model, _ = load_model(trained[0])
    prompt = list(b"import ")
    assert generate(model, prompt, 20, greedy=False, top_p=1e-6, seed=3) == generate(
        model, prompt, 20, greedy=True
    )
    a = generate(model, prompt, 20, greedy=False, top_p=0.95, seed=3)
    assert a == generate(model, prompt, 20, greedy=False, top_p=0.95, seed=3)
    assert a != generate(model, prompt, 20, greedy=False, top_p=0.95, seed=4)


@pytest.mark.slow
def test_perplexity_of_trained_model_on_held_out_stdlib(trained):
    d, untrained = trained
    assert untrained["perplexity"] > 200  # measured 272.25 at initialisation
    model, _ = load_model(d)
    got = perplexity(model, list(HELD_OUT.read_bytes()), 256)
    assert got["tokens"] == len(HELD_OUT.read_bytes()) - 1
    assert math.isclose(got["perplexity"], math.exp(got["nll_per_token"]))
    assert got["perplexity"] < 18  # measured 14.68 (2026-11-29, 1 thread); uniform would be 256


@pytest.mark.slow
def test_generate_cli_json(trained, capsys):
    d, _ = trained
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(d),
                "--prompt",
                "def f(",
                "--max-new-tokens",
                "16",
                "--greedy",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    model, _ = load_model(d)
    assert out["ids"] == generate(model, list(b"def f("), 16) and out["prompt_ids"] == list(
        b"def f("
    )
    assert out["text"] == bytes(out["ids"]).decode("utf-8", errors="replace")
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(d),
                "--eval-file",
                str(HELD_OUT),
                "--eval-seq",
                "256",
                "--json",
            ]
        )
        == 0
    )
    ev = json.loads(capsys.readouterr().out)
    assert ev["perplexity"] == perplexity(model, list(HELD_OUT.read_bytes()), 256)["perplexity"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--prompt-ids", "1,x"], "--prompt-ids '1,x': give integers"),
        (["--prompt-ids", "1,256"], "prompt id 256 is outside the model's vocabulary 0..255"),
        (["--prompt", "ab", "--max-new-tokens", "300"], "exceeds the model's max_seq 256"),
        (["--prompt", "ab", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    ],
)
def test_generate_cli_bad_input(trained, capsys, argv, needle):
    assert main(["generate", "--ckpt", str(trained[0]), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_generate_refuses_a_directory_without_manifest(tmp_path, capsys):
    assert main(["generate", "--ckpt", str(tmp_path), "--prompt", "a"]) == 2
    assert "no manifest.json; not a fourd checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_holdout_scores_the_corpus_tail(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FOURD_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join((STDLIB / f).read_bytes() for f in ("textwrap.py", "shlex.py")))
    raw = corpus.read_bytes()
    tail = list(raw[int(len(raw) * 0.9) :])  # data.holdout_fraction = 0.1: the last tenth
    argv = [
        "generate",
        "--ckpt",
        str(trained[0]),
        "--eval-holdout",
        str(corpus),
        "--holdout-fraction",
        "0.1",
        "--eval-seq",
        "256",
        "--json",
    ]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    model, _ = load_model(trained[0])
    assert got["tokens"] == len(tail) - 1
    assert got["perplexity"] == perplexity(model, tail, 256)["perplexity"]
    assert main(argv + ["--eval-tokens", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 999


# ---- the run a checkpoint records: no flag repeated, a contradicting flag refused ---------------------


def _trained_on_jsonl(tmp_path, trained, tokenizer="byte"):
    """A run directory whose checkpoint records its run as `fourd train` does (Checkpointer(info=...)):
    the trained weights, a JSONL corpus, data.seq_len 128 and data.holdout_fraction 0.1."""
    from fourd.ckpt.dcp_io import Checkpointer
    from fourd.config import Config
    from fourd.data.dataset import prepare
    from fourd.data.tokenizer import load_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    docs = [(STDLIB / f).read_text() for f in ("textwrap.py", "shlex.py")]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    run = tmp_path / "run"
    cfg = Config()
    cfg.data.path, cfg.data.seq_len, cfg.data.holdout_fraction, cfg.data.tokenizer = (
        str(corpus),
        128,
        0.1,
        tokenizer,
    )
    cfg.model.preset, cfg.run.dir = "debug", str(run)
    cache = prepare(str(corpus), tokenizer)
    data = {
        "path": str(corpus),
        "tokenizer": tokenizer,
        "identity": load_tokenizer(tokenizer).identity(),
    }
    info = {"data": {**data, "source": cache.source, "tokens": cache.tokens}}
    model, _ = load_model(trained)
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(cfg, [model], opt, layout="dp=1", contributes=True, info=info).save(60, 960)
    return run, "\n\n".join(docs).encode()


@pytest.mark.slow
def test_eval_holdout_scores_the_runs_own_corpus_with_no_flags(
    trained, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("FOURD_HOME", str(tmp_path / "home"))
    run, raw = _trained_on_jsonl(tmp_path, trained[0])
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(run), "--eval-holdout", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    tail = list(
        raw[int(len(raw) * 0.9) :]
    )  # the last tenth of the JSONL's documents joined by blank lines
    model, _ = load_model(trained[0])
    assert got["tokens"] == len(tail) - 1
    assert got["perplexity"] == perplexity(model, tail, 128)["perplexity"]  # the run's data.seq_len
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(run),
                "--eval-holdout",
                str(tmp_path / "corpus.jsonl"),
                "--json",
            ]
        )
        == 0
    )
    assert (
        json.loads(capsys.readouterr().out) == got
    )  # naming the run's own corpus is no contradiction


@pytest.mark.slow
def test_flags_that_contradict_the_run_are_refused(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FOURD_HOME", str(tmp_path / "home"))
    run, _ = _trained_on_jsonl(tmp_path, trained[0])
    other = tmp_path / "other.txt"
    other.write_text("x" * 5000)
    bpe = tmp_path / "tokenizer.model"  # a valid tiktoken file: the 256 bytes, no merges
    bpe.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    corpus = tmp_path / "corpus.jsonl"
    cases = [
        (
            ["--eval-holdout", str(other)],
            f"--eval-holdout '{other}' differs from the run's '{corpus}'; leave --eval-holdout out to use the run's",
        ),
        (
            ["--eval-holdout", "--holdout-fraction", "0.2"],
            "--holdout-fraction 0.2 differs from the run's 0.1; leave --holdout-fraction out to use the run's",
        ),
        (
            ["--prompt", "a", "--tokenizer", str(bpe)],
            f"--tokenizer '{bpe}' is not the run's tokenizer ('byte')",
        ),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(["generate", "--ckpt", str(run), *argv]) == 2
        assert capsys.readouterr().err.startswith(f"fourd: error: {message}")
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "appended after training"}) + "\n")
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(run), "--eval-holdout"]) == 2
    err = capsys.readouterr().err
    assert (
        "when the run trained: it changed, so its tail is not the held-out part; use --eval-file"
        in err
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "nan"], "--temperature nan must be a finite number > 0"),
        (["--temperature", "inf"], "--temperature inf must be a finite number > 0"),
        (["--temperature", "-1"], "--temperature -1.0 must be a finite number > 0"),
        (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (["--top-p", "nan"], "--top-p nan must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
        (["--max-new-tokens", "-3"], "--max-new-tokens -3 must be at least 1"),
        (["--stop-id", "999"], "--stop-id 999 is outside the model's vocabulary 0..255"),
        (["--stop-id", "-1"], "--stop-id -1 is outside the model's vocabulary 0..255"),
        (["--eval-tokens", "-1"], "--eval-tokens -1 must be >= 0 (0: all)"),
        (["--eval-seq", "0"], "--eval-seq 0 must be at least 1"),
        (["--prompt", ""], "the prompt is empty: give --prompt text or --prompt-ids"),
    ],
)
def test_numbers_out_of_range_are_refused(trained, capsys, argv, message):
    prompt = [] if "--prompt" in argv else ["--prompt", "ab"]
    assert main(["generate", "--ckpt", str(trained[0]), *prompt, *argv]) == 2
    assert capsys.readouterr().err == f"fourd: error: {message}\n"


@pytest.mark.slow
def test_generate_says_when_it_skips_a_damaged_newer_checkpoint(trained, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained[0], run / "checkpoints" / "step-60")
    (run / "checkpoints" / "step-80").mkdir()
    (run / "checkpoints" / "step-80" / "manifest.json").write_text(
        '{"format": "fourd-checkpoint"'
    )  # torn
    argv = [
        "generate",
        "--ckpt",
        str(run),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "4",
        "--greedy",
        "--json",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "fourd: warning: falling back to the previous complete checkpoint step-60 (skipped damaged step-80)\n"
    )
    model, _ = load_model(trained[0])
    assert json.loads(captured.out)["ids"] == generate(model, list(b"def "), 4)
