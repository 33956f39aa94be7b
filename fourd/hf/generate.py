"""Generate tokens from a checkpoint (greedy or top-p sampling, with a KV cache), or score text.

A checkpoint of `fourd train` records its run: the tokenizer, the corpus, the sequence length and the
held-out fraction come from it, so no flag is repeated; a flag that contradicts the run is refused.

examples:
  fourd generate --ckpt runs/demo --prompt "def main(" --max-new-tokens 64     # a run's newest checkpoint
  fourd generate --ckpt runs/demo --prompt-ids 5,17,42 --greedy --json         # {"ids": [...], ...}
  fourd generate --ckpt runs/demo --prompt "import " --top-p 0.9 --temperature 0.8 --seed 1
  fourd generate --ckpt runs/demo --eval-holdout --json     # the tail of the run's corpus it never trained on
  fourd generate --ckpt runs/demo --eval-file held_out.py --json               # nll_per_token, perplexity
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from fourd.errors import FourdError


def add_arguments(p) -> None:
    p.add_argument("--ckpt", required=True, metavar="DIR", help="a checkpoint, or a run directory (its newest one)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="prompt text, encoded with the run's tokenizer")
    what.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma separated")
    what.add_argument("--eval-file", metavar="FILE", help="score this text file instead: per-token NLL and perplexity")
    what.add_argument(
        "--eval-holdout", nargs="?", const="", metavar="CORPUS", help="score the held-out tail of the run's corpus"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--top-p", type=float, default=0.9, help="sample from the most likely tokens holding this mass")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-id", type=int, action="append", metavar="ID", help="stop after this id (repeatable)")
    p.add_argument("--tokenizer", metavar="PATH", help="'byte', tokenizer.json or tiktoken BPE (default: the run's)")
    p.add_argument("--eval-seq", type=int, help="tokens per scored window (default: the run's data.seq_len)")
    p.add_argument("--eval-tokens", type=int, default=65536, help="--eval-holdout: the first N tokens (0: all)")
    p.add_argument("--holdout-fraction", type=float, help="--eval-holdout: the run's data.holdout_fraction")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _check_numbers(args) -> None:
    bad = [
        (args.max_new_tokens < 1, f"--max-new-tokens {args.max_new_tokens} must be at least 1"),
        (not 0 < args.top_p <= 1, f"--top-p {args.top_p} must be in (0, 1]"),
        (not 0 < args.temperature < math.inf, f"--temperature {args.temperature} must be a finite number > 0"),
        (args.eval_tokens < 0, f"--eval-tokens {args.eval_tokens} must be >= 0 (0: all)"),
        (args.eval_seq is not None and args.eval_seq < 1, f"--eval-seq {args.eval_seq} must be at least 1"),
    ]
    for wrong, message in bad:
        if wrong:
            raise FourdError(message)


def _check_ids(ids: list[int], vocab: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise FourdError(f"{what} {bad[0]} is outside the model's vocabulary 0..{vocab - 1}")


def run(args) -> int:
    from fourd.ckpt import store
    from fourd.hf.inference import load_model

    _check_numbers(args)
    model, manifest = load_model(args.ckpt)
    tok = run_tokenizer(manifest, args.tokenizer)
    if args.eval_file is not None or args.eval_holdout is not None:
        return _run_eval(args, model, tok, manifest)
    try:
        prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()] if args.prompt_ids else []
    except ValueError:
        raise FourdError(f"--prompt-ids {args.prompt_ids!r}: give integers separated by commas, e.g. 5,17,42") from None
    prompt = prompt if args.prompt_ids else tok.encode(args.prompt)
    if not prompt:
        raise FourdError("the prompt is empty: give --prompt text or --prompt-ids")
    eos = manifest.get("hf_config", {}).get("eos_token_id")
    stop = args.stop_id if args.stop_id is not None else ([eos] if isinstance(eos, int) else eos or [])
    if not isinstance(stop, list) or not all(isinstance(i, int) for i in stop):
        raise FourdError(f"{store.MANIFEST}: hf_config.eos_token_id = {eos!r} is not token ids; give --stop-id")
    _check_ids(prompt, model.cfg.vocab, "prompt id")
    _check_ids(stop, model.cfg.vocab, "--stop-id" if args.stop_id else "eos_token_id")
    if len(prompt) + args.max_new_tokens > model.cfg.max_seq:
        raise FourdError(
            f"prompt ({len(prompt)}) + --max-new-tokens ({args.max_new_tokens}) exceeds the model's "
            f"max_seq {model.cfg.max_seq}; shorten one of them"
        )
    from fourd.hf.inference import generate

    t0 = time.perf_counter()
    ids = generate(model, prompt, args.max_new_tokens, args.greedy, args.top_p, args.temperature, args.seed, stop)
    elapsed = time.perf_counter() - t0
    text = tok.decode([i for i in ids if i < tok.vocab_size])
    if args.json:
        out = {"ids": ids, "prompt_ids": prompt, "text": text, "new_tokens": len(ids)}
        print(json.dumps({**out, "tokens_per_s": len(ids) / elapsed if elapsed > 0 else None}))
    else:
        print(text)
    return 0


def _spec(given: str | None, data: dict) -> str:
    return given if given is not None else data.get("tokenizer") or "byte"


def run_tokenizer(manifest: dict, given: str | None):
    """The tokenizer the run trained with (byte-level when unrecorded); `given` must be the same one."""
    from fourd.data.tokenizer import load_tokenizer

    data = manifest.get("train", {}).get("data", {})
    tok = load_tokenizer(_spec(given, data))
    if "identity" in data and tok.identity() != data["identity"]:
        if given is None:
            raise FourdError(f"tokenizer {data.get('tokenizer')!r} changed since the run trained with it; restore it")
        raise FourdError(f"--tokenizer {given!r} is not the run's tokenizer ({data.get('tokenizer')!r}); leave it out")
    return tok


def _same(given: Any, recorded: Any, flag: str) -> Any:
    if given is not None and recorded is not None and given != recorded:
        raise FourdError(f"{flag} {given!r} differs from the run's {recorded!r}; leave {flag} out to use the run's")
    return recorded if recorded is not None else given


def holdout_ids(args, manifest: dict) -> list[int]:
    """The tail of the run's corpus that `fourd train` kept out of training."""
    from fourd.ckpt.store import recorded
    from fourd.data.dataset import prepare, split

    data = manifest.get("train", {}).get("data", {})
    given = str(Path(args.eval_holdout).expanduser().resolve()) if args.eval_holdout else None
    path = (str(Path(data["path"]).expanduser().resolve()) if data["path"] else "") if "path" in data else None
    corpus = _same(given, path, "--eval-holdout") or ""
    fraction = _same(args.holdout_fraction, recorded(manifest, "data", "holdout_fraction", float), "--holdout-fraction")
    cache_dir = recorded(manifest, "data", "cache_dir", str) or ""
    cache = prepare(str(corpus), _spec(args.tokenizer, data), cache_dir)
    if data.get("tokens") not in (None, cache.tokens):
        raise FourdError(
            f"the corpus {corpus or 'standard library'!r} has {cache.tokens} tokens, {data['tokens']} when the run "
            "trained: it changed, so its tail is not the held-out part; use --eval-file"
        )
    train_tokens, _ = split(cache.tokens, 1, 0.01 if fraction is None else fraction)
    ids = cache.array()[train_tokens:].tolist()
    return ids[: args.eval_tokens] if args.eval_tokens > 0 else ids


def _run_eval(args, model, tok, manifest: dict) -> int:
    from fourd.ckpt.store import recorded
    from fourd.hf.inference import perplexity

    if args.eval_holdout is not None:
        ids = holdout_ids(args, manifest)
    else:
        from fourd.data.corpus import read_regular

        try:
            ids = tok.encode(read_regular(args.eval_file, "--eval-file", "give a UTF-8 text file").decode("utf-8"))
        except UnicodeDecodeError as e:
            raise FourdError(f"--eval-file {args.eval_file!r} is not UTF-8 text (byte {e.start})") from None
    seq = args.eval_seq or recorded(manifest, "data", "seq_len", int) or min(model.cfg.max_seq, 1024)
    if seq > model.cfg.max_seq:
        raise FourdError(f"--eval-seq {seq} exceeds the model's max_seq {model.cfg.max_seq}")
    if len(ids) < 2:
        raise FourdError("the evaluation text has fewer than 2 tokens; give a longer text")
    _check_ids(ids, model.cfg.vocab, "token id")
    result = perplexity(model, ids, seq)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['tokens']} tokens: {result['nll_per_token']:.4f} nats/token, perplexity {result['perplexity']:.3f}"
        )
    return 0
