"""Generate tokens from a checkpoint (greedy or top-p sampling, with a KV cache), or score text.

The tokenizer, corpus, sequence length and held-out fraction come from the run the checkpoint
records: no flag is repeated, and a flag that contradicts the run is refused.

examples:
  fourd train --model debug --steps 20 --train.global_batch=4 --run-dir runs/demo  # a run to try
  fourd generate --ckpt runs/demo --prompt "def main(" --max-new-tokens 64  # its newest checkpoint
  fourd generate --ckpt runs/demo --prompt-ids 5,17,42 --greedy --json  # {"ids": [...], ...}
  fourd generate --ckpt runs/demo --prompt "import " --top-p 0.9 --temperature 0.8 --seed 1
  fourd generate --ckpt runs/demo --eval-holdout --json  # the corpus tail it never trained on
  fourd generate --ckpt runs/demo --eval-file README.md --json  # nll_per_token, perplexity
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from fourd.config import DataSection
from fourd.data.corpus import read_regular
from fourd.data.dataset import absolute_mix, open_data
from fourd.errors import FourdError
from fourd.hf.convert import run_tokenizer, tokenizer_spec


def add_arguments(parser) -> None:
    parser.add_argument(
        "--ckpt",
        required=True,
        metavar="DIR",
        help="a checkpoint, or a run directory (its newest one)",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--prompt", metavar="TEXT", help="prompt text, encoded with the run's tokenizer"
    )
    what.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma separated")
    what.add_argument(
        "--eval-file",
        metavar="FILE",
        help="score this text file instead: per-token NLL and perplexity",
    )
    what.add_argument(
        "--eval-holdout",
        nargs="?",
        const="",
        metavar="CORPUS",
        help="score the run's held-out tail",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument(
        "--top-p",
        type=float,
        default=0.9,
        help="sample from the most likely tokens holding this mass",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop-id", type=int, action="append", metavar="ID", help="stop after this id (repeatable)"
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="'byte', tokenizer.json or tiktoken BPE (default: the run's)",
    )
    parser.add_argument(
        "--eval-seq", type=int, help="tokens per scored window (default: the run's data.seq_len)"
    )
    parser.add_argument(
        "--eval-tokens", type=int, default=65536, help="--eval-holdout: the first N tokens (0: all)"
    )
    parser.add_argument(
        "--holdout-fraction", type=float, help="--eval-holdout: the run's data.holdout_fraction"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _refuse_if(wrong: bool, message: str) -> None:
    if wrong:
        raise FourdError(message)


def _check_ids(ids: list, vocab: int, what: str) -> None:
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < vocab]
    if bad:
        raise FourdError(f"{what} {bad[0]} is outside the model's vocabulary 0..{vocab - 1}")


def run(args) -> int:
    from fourd.hf.inference import generate, load_model

    _refuse_numbers_out_of_range(args)
    model, manifest = load_model(args.ckpt)
    tok = run_tokenizer(manifest, args.tokenizer)
    cfg = model.cfg
    if args.eval_file is not None or args.eval_holdout is not None:
        return _run_eval(args, model, tok, manifest)
    prompt = _prompt_ids(args, tok)
    stop = _stop_ids(args, manifest)
    _check_ids(prompt, cfg.vocab, "prompt id")
    stop_source = "eos_token_id"
    if args.stop_id:
        stop_source = "--stop-id"
    _check_ids(stop, cfg.vocab, stop_source)
    total = f"prompt ({len(prompt)}) + --max-new-tokens ({args.max_new_tokens})"
    too_long = f"{total} exceeds the model's max_seq {cfg.max_seq}; shorten one of them"
    _refuse_if(len(prompt) + args.max_new_tokens > cfg.max_seq, too_long)
    began = time.perf_counter()
    ids = generate(
        model,
        prompt,
        args.max_new_tokens,
        greedy=args.greedy,
        top_p=args.top_p,
        temperature=args.temperature,
        seed=args.seed,
        stop_ids=stop,
    )
    rate = len(ids) / max(time.perf_counter() - began, 1e-9)
    text = tok.decode([token for token in ids if token < tok.vocab_size])
    out = {
        "ids": ids,
        "prompt_ids": prompt,
        "text": text,
        "new_tokens": len(ids),
        "tokens_per_s": rate,
    }
    _print(args, out, text)
    return 0


def _refuse_numbers_out_of_range(args) -> None:
    """Refuse --max-new-tokens, --top-p, --temperature, --eval-tokens, --eval-seq out of range."""
    _refuse_if(
        args.max_new_tokens < 1, f"--max-new-tokens {args.max_new_tokens} must be at least 1"
    )
    _refuse_if(not 0 < args.top_p <= 1, f"--top-p {args.top_p} must be in (0, 1]")
    _refuse_if(
        not 0 < args.temperature < math.inf,
        f"--temperature {args.temperature} must be a finite number > 0",
    )
    _refuse_if(args.eval_tokens < 0, f"--eval-tokens {args.eval_tokens} must be >= 0 (0: all)")
    _refuse_if(
        args.eval_seq is not None and args.eval_seq < 1,
        f"--eval-seq {args.eval_seq} must be at least 1",
    )


def _prompt_ids(args, tok) -> list[int]:
    """The prompt's token ids, from --prompt-ids or the encoded --prompt; refuses an empty one."""
    try:
        if args.prompt_ids is not None:
            prompt = [int(piece) for piece in args.prompt_ids.split(",") if piece.strip()]
        else:
            prompt = tok.encode(args.prompt)
    except ValueError:
        raise FourdError(
            f"--prompt-ids {args.prompt_ids!r}: give integers separated by commas, e.g. 5,17,42"
        ) from None
    _refuse_if(not prompt, "the prompt is empty: give --prompt text or --prompt-ids")
    return prompt


def _stop_ids(args, manifest: dict) -> list[int]:
    """The ids that end generation: --stop-id's, else the manifest's eos_token_id (none without)."""
    eos = manifest.get("hf_config", {}).get("eos_token_id")  # a model converted from Hugging Face
    if args.stop_id is not None:
        stop = args.stop_id
    elif isinstance(eos, int):
        stop = [eos]
    else:
        stop = eos or []
    _refuse_if(
        not isinstance(stop, list),
        f"manifest.json: hf_config.eos_token_id = {eos!r} is not token ids",
    )
    return stop


def _print(args, out: dict, text: str) -> None:
    """The JSON object with --json, else the text."""
    if args.json:
        print(json.dumps(out))
    else:
        print(text)


def _same(given: Any, recorded: Any, flag: str) -> Any:
    message = (
        f"{flag} {given!r} differs from the run's {recorded!r}; leave {flag} out to use the run's"
    )
    _refuse_if(given is not None and recorded is not None and given != recorded, message)
    if recorded is not None:
        return recorded
    return given


def _corpus(given: str, mixture: bool) -> str:
    """--eval-holdout's CORPUS as a run records it: absolute paths, each DIR of a mixture's."""
    if mixture and "=" in given:
        return absolute_mix(given)
    return str(Path(given).expanduser().resolve())


def holdout_ids(args, manifest: dict) -> list[int]:
    """The held-out tail that `fourd train` evaluates on (for a mixture, its first dataset's), from
    the data the run recorded (today's defaults for runs that recorded none: the standard library,
    the default data.holdout_fraction)."""
    data = manifest.get("train", {}).get("data", {})
    # typed by the manifest's schema
    recorded = manifest.get("train", {}).get("config", {}).get("data", {})
    mix = recorded.get("mix", "")
    given = None
    if args.eval_holdout:
        given = _corpus(args.eval_holdout, bool(mix))
    path = ""
    if mix:
        mix = _same(given, absolute_mix(mix), "--eval-holdout")
    else:
        recorded_path = None  # the run recorded no corpus
        if data.get("path"):
            recorded_path = str(Path(data["path"]).expanduser().resolve())
        elif "path" in data:
            recorded_path = ""  # the standard library
        path = _same(given, recorded_path, "--eval-holdout") or ""
    fraction = _same(args.holdout_fraction, recorded.get("holdout_fraction"), "--holdout-fraction")
    section = DataSection(
        path=path,
        mix=mix,
        tokenizer=tokenizer_spec(args.tokenizer, data),
        cache_dir=recorded.get("cache_dir", ""),
    )
    if fraction is not None:
        section.holdout_fraction = fraction
    cache = open_data(section)
    changed = (
        f"the corpus {mix or path or 'standard library'!r} has {cache.tokens} tokens, "
        f"{data.get('tokens')} when the run trained: it changed, so its tail is not the held-out "
        "part; use --eval-file"
    )
    _refuse_if(data.get("tokens") not in (None, cache.tokens), changed)
    # The trainer's own stream; where its held-out tail starts depends on neither seq_len nor seed.
    tail = cache.stream(1, 0, section.holdout_fraction).holdout()
    count = len(tail)
    if args.eval_tokens > 0:
        count = min(count, args.eval_tokens)
    return tail[0:count].tolist()


def _run_eval(args, model, tok, manifest: dict) -> int:
    from fourd.hf.inference import perplexity

    if args.eval_holdout is not None:
        ids = holdout_ids(args, manifest)
    else:
        raw = read_regular(args.eval_file, "--eval-file", "give a UTF-8 text file")
        try:
            ids = tok.encode(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise FourdError(
                f"--eval-file {args.eval_file!r} is not UTF-8 text (byte {error.start})"
            ) from None
    recorded = manifest.get("train", {}).get("config", {}).get("data", {})
    seq = args.eval_seq
    if seq is None:
        seq = recorded.get("seq_len") or min(model.cfg.max_seq, 1024)
    _refuse_if(
        seq > model.cfg.max_seq, f"--eval-seq {seq} exceeds the model's max_seq {model.cfg.max_seq}"
    )
    _refuse_if(len(ids) < 2, "the evaluation text has fewer than 2 tokens; give a longer text")
    _check_ids(ids, model.cfg.vocab, "token id")
    scores = perplexity(model, ids, seq)
    text = (
        f"{scores['tokens']} tokens: {scores['nll_per_token']:.4f} nats/token, perplexity "
        f"{scores['perplexity']:.3f}"
    )
    _print(args, scores, text)
    return 0
