"""`fourd data prepare` beside the tokenizers library's batch encoding; train start-up vs size.

    python benchmarks/data_prepare.py --mb 200 --repeats 3 --work /tmp/data-bench

1. Writes a synthetic JSONL corpus of about --mb MB (Zipf-distributed words, documents of 50-2,000
   words) and trains an 8,000-token byte-level BPE tokenizer.json on its first 5 MB.
2. Side by side, --repeats times: `fourd data prepare` of the corpus (a fresh process; its wall
   time and peak resident memory from wait4), and the same documents, already in memory, encoded
   by the library's `encode_batch` (and `encode_batch_fast`, which fourd uses) in batches of 1,024
   on the same cores (no reading, no writing).
3. `fourd train --model debug --steps 1` start-up on the prepared corpus and on a prepared 1 MB
   corpus (a warm-up start each, then --repeats starts each): the time to the end of the process.
Prints one JSON object of medians; docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BATCH = 1024


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL corpus of about `megabytes` MB; its number of documents."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=int(rng.integers(1, 9)))) for _ in range(30_000)]
    ranks = 1.0 / np.arange(1, len(words) + 1)  # Zipf's law: frequency ∝ 1 / rank
    weights = ranks / ranks.sum()
    documents = 0
    with open(path, "w") as f:
        while f.tell() < megabytes * 1e6:
            picks = rng.choice(len(words), size=int(rng.integers(50, 2000)), p=weights)
            text = " ".join(words[k] for k in picks)
            f.write(json.dumps({"text": text}) + "\n")
            documents += 1
    return documents


def train_tokenizer(corpus: Path, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    sample = []
    with open(corpus) as f:
        while sum(map(len, sample)) < 5e6:
            sample.append(json.loads(f.readline())["text"])
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["[UNK]", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sample, trainer)
    tok.save(str(out))


def fourd(*argv) -> tuple[float, float, int]:
    """(wall seconds, peak resident MB, exit status) of `fourd ARGV` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "fourd", *map(str, argv)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def library_encode(corpus: Path, tokenizer: Path, method: str) -> tuple[float, int]:
    """(seconds, tokens) of the library's `method` (encode_batch, encode_batch_fast) over every
    document, all read into memory first."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    with open(corpus) as f:
        docs = [json.loads(line)["text"] for line in f]
    start = time.perf_counter()
    tokens = 0
    for first in range(0, len(docs), BATCH):
        batch = getattr(tok, method)(docs[first : first + BATCH], add_special_tokens=False)
        tokens += sum(len(e.ids) for e in batch)
    return time.perf_counter() - start, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=200.0, help="corpus size in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default="/tmp/fourd-data-bench", help="scratch folder (not the repo)")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus, small, tokenizer = work / "corpus.jsonl", work / "small.jsonl", work / "tok.json"
    if not corpus.exists():
        write_corpus(corpus, args.mb)
        write_corpus(small, 1.0, seed=1)
        train_tokenizer(corpus, tokenizer)
    size = corpus.stat().st_size
    prepare_s, rss_mb, library_s, fast_s = [], [], [], []
    for _ in range(args.repeats):
        shutil.rmtree(work / "prepared", ignore_errors=True)
        seconds, peak, code = fourd(
            "data", "prepare", corpus, "--tokenizer", tokenizer, "--out", work / "prepared"
        )
        assert code == 0, "fourd data prepare failed"
        prepare_s.append(seconds)
        rss_mb.append(peak)
        seconds, library_tokens = library_encode(corpus, tokenizer, "encode_batch")
        library_s.append(seconds)
        fast_s.append(library_encode(corpus, tokenizer, "encode_batch_fast")[0])
    manifest = json.loads((work / "prepared" / "manifest.json").read_text())
    shutil.rmtree(work / "small-prepared", ignore_errors=True)
    fourd("data", "prepare", small, "--tokenizer", tokenizer, "--out", work / "small-prepared")
    starts: dict[str, list[float]] = {"large": [], "small": []}
    for name, folder in (("large", work / "prepared"), ("small", work / "small-prepared")):
        for attempt in range(args.repeats + 1):  # the first: a warm-up start
            run = work / f"run-{name}-{attempt}"
            shutil.rmtree(run, ignore_errors=True)
            argv = ["train", "--model", "debug", "--model.vocab", 8000, "--steps", 1]
            seconds, _, code = fourd(*argv, "--data.path", folder, "--run-dir", run)
            assert code == 0, "fourd train failed"
            if attempt:
                starts[name].append(seconds)
    prepare_median, library_median = statistics.median(prepare_s), statistics.median(library_s)
    result = {
        "corpus_mb": round(size / 1e6, 1),
        "documents": manifest["documents"],
        "tokens": manifest["tokens"],
        "library_tokens": library_tokens,
        "cores": os.cpu_count(),
        "prepare_s": round(prepare_median, 2),
        "prepare_mb_per_s": round(size / 1e6 / prepare_median, 2),
        "library_encode_batch_s": round(library_median, 2),
        "library_mb_per_s": round(size / 1e6 / library_median, 2),
        "prepare_vs_library": round(library_median / prepare_median, 3),
        "library_encode_batch_fast_s": round(statistics.median(fast_s), 2),
        "prepare_vs_library_fast": round(statistics.median(fast_s) / prepare_median, 3),
        "prepare_peak_rss_mb": round(max(rss_mb)),
        "train_start_large_s": round(statistics.median(starts["large"]), 2),
        "train_start_small_s": round(statistics.median(starts["small"]), 2),
        "all": {"prepare_s": prepare_s, "library_s": library_s, "fast_s": fast_s, "starts": starts},
    }
    result["start_large_vs_small"] = round(
        result["train_start_large_s"] / result["train_start_small_s"], 3
    )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
