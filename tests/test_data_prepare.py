"""fourd data prepare / info / verify / merge: every source format, shards, resume, tasks, bad
input."""

import contextlib
import gzip
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from fourd.cli import main
from fourd.data.dataset import open_prepared, parse_mix
from fourd.data.prepare import Request, dtype_for, prepare_into
from fourd.data.sources import list_sources
from fourd.data.tokenizer import load_tokenizer
from fourd.errors import FourdError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
tokenizers = pytest.importorskip("tokenizers")


def run_fourd(*argv):
    """`fourd ARGV` in this process: (status, stdout, stderr). The data commands start no workers,
    and `fourd train` refuses bad input before it starts any."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(word) for word in argv])
    return code, out.getvalue(), err.getvalue()


WORDS = ["ring", "sends", "chunk", "rank", "the", "to", "a", "next", "héllo", "wörld", "\n"]


def documents(count=60, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for _ in range(count)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained here, with <|eod|> as its end-of-document token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes: the vocabulary exceeds 256
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[UNK]", "<|eod|>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(documents(200), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def jsonl(docs, field="text"):
    return "".join(json.dumps({field: d}) + "\n" for d in docs)


def write_hf_folder(folder, docs):
    """What `datasets.Dataset.save_to_disk` writes: Arrow stream files listed in state.json."""
    folder.mkdir()
    half = len(docs) // 2
    names = []
    for number, part in enumerate((docs[:half], docs[half:])):
        name = f"data-{number:05d}-of-00002.arrow"
        table = pa.table({"id": list(range(len(part))), "text": part})
        with (
            pa.OSFile(str(folder / name), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as w,
        ):
            w.write_table(table, max_chunksize=7)
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names}))
    (folder / "dataset_info.json").write_text("{}")


def write_source(tmp_path, kind, docs):
    """`docs` in the format `kind`; the path to give to fourd data prepare."""
    if kind == "text folder":
        folder = tmp_path / "texts"
        folder.mkdir()
        for number, doc in enumerate(docs):
            (folder / f"{number:03d}.txt").write_text(doc)
        return folder
    if kind == "jsonl":
        (tmp_path / "c.jsonl").write_text(jsonl(docs))
        return tmp_path / "c.jsonl"
    if kind == "jsonl.gz":
        with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
            f.write(jsonl(docs))
        return tmp_path / "c.jsonl.gz"
    if kind == "jsonl.zst":
        data = zstandard.ZstdCompressor().compress(jsonl(docs).encode())
        (tmp_path / "c.jsonl.zst").write_bytes(data)
        return tmp_path / "c.jsonl.zst"
    if kind == "parquet":
        pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=9)
        return tmp_path / "c.parquet"
    if kind == "parquet folder":
        folder = tmp_path / "pq"
        folder.mkdir()
        for number, start in enumerate(range(0, len(docs), 25)):
            pq.write_table(
                pa.table({"text": docs[start : start + 25]}), folder / f"{number}.parquet"
            )
        return folder
    write_hf_folder(tmp_path / "hf", docs)
    return tmp_path / "hf"


KINDS = [
    "text folder",
    "jsonl",
    "jsonl.gz",
    "jsonl.zst",
    "parquet",
    "parquet folder",
    "hf datasets",
]


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_are_each_document_encoded_alone_joined_by_the_eod_token(tmp_path, bpe, kind):
    docs = documents()
    src = write_source(tmp_path, kind, docs)
    code, out, err = run_fourd("data", "prepare", src, "--tokenizer", bpe, "--out", tmp_path / "d")
    assert code == 0, err
    tok = load_tokenizer(bpe)
    eod = tok.special_token()[1]
    expected = [i for d in docs for i in (*tok.encode(d), eod)][:-1]
    data = open_prepared(tmp_path / "d")
    assert data.read(0, data.tokens).tolist() == expected
    assert data.dtype == "uint16" and eod == 1
    code, out, _ = run_fourd("data", "info", tmp_path / "d", "--json")
    info = json.loads(out)
    assert (info["tokens"], info["documents"]) == (len(expected), len(docs))
    assert info["eod"] == {"ids": [1], "text": "<|eod|>", "from": "the tokenizer's own token"}


def test_byte_level_with_an_eod_id_and_shards_that_split_the_stream(tmp_path):
    docs = documents(40)
    src = write_source(tmp_path, "jsonl", docs)
    argv = ["--tokenizer", "byte", "--eod-id", "256", "--shard-tokens", "300"]
    code, _, err = run_fourd("data", "prepare", src, *argv, "--out", tmp_path / "d")
    assert code == 0, err
    data = open_prepared(tmp_path / "d")
    expected = [i for d in docs for i in (*d.encode(), 256)][:-1]
    assert data.read(0, data.tokens).tolist() == expected and data.vocab_size == 257
    assert len(data.shards) > 3  # the stream reads across shard boundaries
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert sum(s["documents"] for s in manifest["shards"]) == 40
    assert all(s["tokens"] >= 300 for s in manifest["shards"][:-1])
    ends = np.fromfile(tmp_path / "d" / "shard-00000.idx", dtype="<u8")
    assert ends[0] == len(docs[0].encode()) + 1  # the first document and its end-of-document id


def test_verify_names_a_damaged_shard_or_index_with_exit_status_2(tmp_path):
    src = write_source(tmp_path, "jsonl", documents())
    assert run_fourd("data", "prepare", src, "--tokenizer", "byte", "--out", tmp_path / "d")[0] == 0
    code, out, _ = run_fourd("data", "verify", tmp_path / "d")
    assert code == 0 and "ok, 1 shard" in out
    shard = tmp_path / "d" / "shard-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    code, _, err = run_fourd("data", "verify", tmp_path / "d")
    assert code == 2
    assert err == (
        f"fourd: error: {shard}: its SHA-256 differs from the manifest's: the file is damaged; "
        "prepare the dataset again\n"
    )
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))  # the shard whole again; now its document index
    index = tmp_path / "d" / "shard-00000.idx"
    ends = bytearray(index.read_bytes())
    ends[0] ^= 1
    index.write_bytes(bytes(ends))
    code, _, err = run_fourd("data", "verify", tmp_path / "d")
    assert (code, err) == (
        2,
        f"fourd: error: {index}: its SHA-256 differs from the manifest's: the file is damaged; "
        "prepare the dataset again\n",
    )


def test_ids_are_stored_in_16_bits_up_to_a_vocabulary_of_2_to_the_16_and_in_32_beyond():
    """Ids run from 0 to vocab − 1: a vocabulary of 65,536 fits uint16, one more id does not."""
    assert [dtype_for(vocab) for vocab in (257, 65_536, 65_537, 128_256)] == [
        "uint16",
        "uint16",
        "uint32",
        "uint32",
    ]


def test_the_held_out_tail_is_whole_documents(tmp_path):
    docs = documents(200)
    src = write_source(tmp_path, "jsonl", docs)
    argv = ["--tokenizer", "byte", "--holdout-fraction", "0.1", "--out", tmp_path / "d"]
    assert run_fourd("data", "prepare", src, *argv)[0] == 0
    data = open_prepared(tmp_path / "d")
    first = data.held_out_start(0.1)
    stream = [i for d in docs for i in (*d.encode(), 10, 10)][:-2]
    starts = np.cumsum([0] + [len(d.encode()) + 2 for d in docs])
    assert first in starts and first >= int(len(stream) * 0.9)  # a document starts there
    assert first == min(s for s in starts if s >= int(len(stream) * 0.9))
    assert data.stream(16, 0, 0.1).holdout().tolist() == stream[first:]


def test_an_interrupted_prepare_continues_from_its_finished_shards(tmp_path, bpe):
    src = write_source(tmp_path, "jsonl", documents(6000))
    argv = ["data", "prepare", src, "--tokenizer", bpe, "--shard-tokens", "5000", "--workers", "1"]
    whole = tmp_path / "whole"
    assert run_fourd(*argv, "--out", whole)[0] == 0
    out, partial = tmp_path / "d", tmp_path / ".d.partial"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fourd", *map(str, argv), "--out", str(out)]
    child = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (partial / "progress.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    if child.returncode != -signal.SIGKILL:
        pytest.skip("the prepare finished before it could be interrupted")
    assert not out.exists()  # no folder that looks complete
    done = json.loads((partial / "progress.json").read_text())["shards"]
    kept = {s["file"]: (partial / s["file"]).stat().st_mtime_ns for s in done}
    code, _, err = run_fourd(*argv, "--out", out)
    assert code == 0, err
    assert all((out / name).stat().st_mtime_ns == mtime for name, mtime in kept.items())
    resumed = json.loads((out / "manifest.json").read_text())
    fresh = json.loads((whole / "manifest.json").read_text())
    assert resumed["shards"] == fresh["shards"] and resumed["sources"] == fresh["sources"]


def test_tasks_as_processes_then_merge_give_the_tokens_of_one_task(tmp_path, bpe):
    folder = tmp_path / "src"
    folder.mkdir()
    for number in range(7):
        (folder / f"{number}.jsonl").write_text(jsonl(documents(30 + 10 * number, seed=number)))
    one = tmp_path / "one"
    assert run_fourd("data", "prepare", folder, "--tokenizer", bpe, "--out", one)[0] == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "fourd", "data", "prepare", str(folder), "--tokenizer", bpe]
    argv += ["--out", str(tmp_path / "many"), "--tasks", "3", "--workers", "1"]
    tasks = [subprocess.Popen([*argv, "--task", str(i)], env=env) for i in range(3)]
    assert [task.wait(timeout=300) for task in tasks] == [0, 0, 0]
    code, _, err = run_fourd("data", "merge", tmp_path / "many")
    assert code == 0, err
    single, merged = open_prepared(one), open_prepared(tmp_path / "many")
    assert merged.tokens == single.tokens and len(merged.shards) == 3
    assert np.array_equal(merged.read(0, merged.tokens), single.read(0, single.tokens))
    assert np.array_equal(merged.document_starts(), single.document_starts())
    assert merged.holdout == single.holdout
    assert run_fourd("data", "verify", tmp_path / "many")[0] == 0


def test_a_raw_corpus_is_found_again_from_sizes_and_mtimes(tmp_path):
    src = write_source(tmp_path, "jsonl", documents())
    request = Request(sources=tuple(list_sources([str(src)])), tokenizer="byte", label=str(src))
    first = prepare_into(request, tmp_path / "d")
    stamp = (tmp_path / "d" / "manifest.json").stat().st_mtime_ns
    again = prepare_into(request, tmp_path / "d")
    assert again == first and (tmp_path / "d" / "manifest.json").stat().st_mtime_ns == stamp


def _refusal(tmp_path, argv):
    code, out, err = run_fourd(*argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("fourd: error: "), err
    return err[len("fourd: error: ") : -1]


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, bpe):
    (tmp_path / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "no"}\n')
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    cases = {
        "notext.jsonl": '{p}:2: no string field "text"; each line must be an object with a "text"',
        "latin1.jsonl": "{p}:2: not UTF-8 (byte 13); convert it to UTF-8",
        "broken.parquet": "{p}: not a readable Parquet file",
        "nocol.parquet": '{p}: no column "text" (it has body): give --text-field',
        "missing.jsonl": "data path '{p}' does not exist",
    }
    for name, message in cases.items():
        path = tmp_path / name
        out = tmp_path / f"out-{name}"
        said = _refusal(tmp_path, ["data", "prepare", path, "--tokenizer", bpe, "--out", out])
        assert said.startswith(message.format(p=path)), said
        assert not out.exists() and not (tmp_path / f".out-{name}.partial").exists()
    said = _refusal(tmp_path, ["data", "info", tmp_path / "nowhere"])
    assert said.startswith(f"{tmp_path / 'nowhere'}: no manifest.json; not a prepared dataset")


@pytest.mark.slow
def test_train_refuses_a_vocabulary_beyond_the_models_and_a_bad_mix_weight(tmp_path, bpe):
    src = write_source(tmp_path, "jsonl", documents())
    assert run_fourd("data", "prepare", src, "--tokenizer", bpe, "--out", tmp_path / "d")[0] == 0
    debug = ["train", "--model", "debug", "--steps", "1", "--model.vocab=256"]
    said = _refusal(tmp_path, [*debug, "--data.path", tmp_path / "d"])
    ids = load_tokenizer(bpe).vocab_size
    assert ids > 256 and said == (
        f"the tokenizer has {ids} ids but the model's vocabulary is 256: set --model.vocab={ids} "
        "or use another tokenizer"
    )
    said = _refusal(tmp_path, [*debug, f"--data.mix={tmp_path / 'd'}=0"])
    assert said == (
        f"data.mix weight of {tmp_path / 'd'} is '0', not a positive number: give a weight > 0"
    )


@pytest.mark.parametrize("weight", ["-1", "x", "inf", "nan"])
def test_a_mix_weight_that_is_not_a_positive_number_is_refused(weight):
    with pytest.raises(FourdError) as e:
        parse_mix(f"data/a=0.5,data/b={weight}")
    assert str(e.value) == (
        f"data.mix weight of data/b is '{weight}', not a positive number: give a weight > 0"
    )


def test_ranks_that_prepare_the_same_cache_entry_at_once_agree(tmp_path, bpe):
    """Under torchrun every rank opens data.path: the entry is built in a folder per process, and the
    first to finish wins."""
    src = write_source(tmp_path, "jsonl", documents(3000))
    code = "import sys; from fourd.data.dataset import prepare; print(prepare(*sys.argv[1:]).path)"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-c", code, str(src), bpe, str(tmp_path / "cache")]
    ranks = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    paths = {rank.communicate(timeout=300)[0].splitlines()[-1] for rank in ranks}
    assert [rank.returncode for rank in ranks] == [0, 0, 0]
    (entry,) = paths
    assert os.listdir(tmp_path / "cache") == [os.path.basename(entry)]
    assert run_fourd("data", "verify", entry)[0] == 0


def test_a_dataset_dict_folder_lists_its_splits_arrow_files_in_its_order(tmp_path):
    """`DatasetDict.save_to_disk`: dataset_dict.json names the splits, each a Dataset folder; their
    files come split by split in the listed order (not the alphabetical one)."""
    root = tmp_path / "dict"
    root.mkdir()
    write_hf_folder(root / "validation", ["a", "b"])
    write_hf_folder(root / "train", ["c", "d"])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["validation", "train"]}))
    found = list_sources([str(root)])
    names = [Path(source.path).relative_to(root.resolve()).as_posix() for source in found]
    assert names == [
        f"{split}/data-0000{number}-of-00002.arrow"
        for split in ("validation", "train")
        for number in (0, 1)
    ]
    assert {source.kind for source in found} == {"arrow"}
