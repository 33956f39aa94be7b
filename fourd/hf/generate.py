"""Generate tokens from a checkpoint (greedy or top-p sampling, with a KV cache), or score a text file.

    fourd generate --ckpt run/checkpoints/step-200 --prompt "def main(" --max-new-tokens 64
    fourd generate --ckpt DIR --prompt-ids 5,17,42 --greedy --json          # {"ids": [...], ...}
    fourd generate --ckpt DIR --prompt "import " --top-p 0.9 --temperature 0.8 --seed 1
    fourd generate --ckpt DIR --tokenizer tokenizer.json --prompt "Hello"
    fourd generate --ckpt DIR --eval-file held_out.py --json                # nll_per_token, perplexity
    fourd generate --ckpt runs/make-run --prompt "import "                  # a run's newest checkpoint
    fourd generate --ckpt runs/make-run --eval-holdout --json               # the stdlib tail training never saw

The tokenizer is byte-level (ids are UTF-8 bytes) unless --tokenizer names a local tokenizer.json or
tiktoken BPE file. Generation stops after --max-new-tokens or at a stop id (--stop-id, else the
eos_token_id of a model converted from Hugging Face).
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from fourd.errors import FourdError


def add_arguments(p) -> None:
    p.add_argument(
        "--ckpt", required=True, metavar="DIR", help="a fourd checkpoint, or a run directory (its newest checkpoint)"
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="prompt text, encoded with --tokenizer")
    what.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma separated")
    what.add_argument("--eval-file", metavar="FILE", help="score this text file instead: per-token NLL and perplexity")
    what.add_argument(
        "--eval-holdout",
        nargs="?",
        const="",
        metavar="CORPUS",
        help="score the held-out tail of a training corpus (default: the standard library, as `fourd train`)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument(
        "--top-p", type=float, default=0.9, help="sample from the smallest set of tokens holding this much probability"
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop-id", type=int, action="append", metavar="ID", help="stop after generating this id (repeatable)"
    )
    p.add_argument(
        "--tokenizer", default="byte", metavar="PATH", help="'byte' (default), tokenizer.json or a tiktoken BPE file"
    )
    p.add_argument(
        "--eval-seq", type=int, default=None, help="scoring: tokens per window (default: min(model max_seq, 1024))"
    )
    p.add_argument(
        "--eval-tokens", type=int, default=65536, help="--eval-holdout: score the first N held-out tokens (0: all)"
    )
    p.add_argument(
        "--holdout-fraction", type=float, default=0.01, help="--eval-holdout: the run's data.holdout_fraction"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from fourd.data.tokenizer import load_tokenizer

    if args.max_new_tokens < 0:
        raise FourdError(f"--max-new-tokens {args.max_new_tokens} must be >= 0")
    if not 0 < args.top_p <= 1:
        raise FourdError(f"--top-p {args.top_p} must be in (0, 1]")
    if args.temperature <= 0:
        raise FourdError(f"--temperature {args.temperature} must be > 0 (use --greedy for the most likely token)")
    tok = load_tokenizer(args.tokenizer)
    model, manifest = load_model(args.ckpt)
    if args.eval_file is not None or args.eval_holdout is not None:
        return _run_eval(args, model, tok)
    if args.prompt_ids is not None:
        try:
            prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise FourdError(
                f"--prompt-ids {args.prompt_ids!r}: give integers separated by commas, e.g. 5,17,42"
            ) from None
    else:
        prompt = tok.encode(args.prompt)
    stop = args.stop_id if args.stop_id is not None else _eos_ids(manifest)
    t0 = time.perf_counter()
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
    elapsed = time.perf_counter() - t0
    text = tok.decode([i for i in ids if i < tok.vocab_size])
    if args.json:
        print(
            json.dumps(
                {
                    "ids": ids,
                    "prompt_ids": prompt,
                    "text": text,
                    "new_tokens": len(ids),
                    "tokens_per_s": len(ids) / elapsed if elapsed > 0 else None,
                }
            )
        )
    else:
        print(text)
    return 0


def _run_eval(args, model, tok) -> int:
    if args.eval_holdout is not None:
        ids = holdout_ids(args.eval_holdout, args.tokenizer, args.holdout_fraction)
        ids = ids[: args.eval_tokens] if args.eval_tokens > 0 else ids
    else:
        try:
            text = open(args.eval_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise FourdError(f"--eval-file {args.eval_file!r} cannot be read as UTF-8 text: {e}") from None
        ids = tok.encode(text)
    seq = args.eval_seq or min(model.cfg.max_seq, 1024)
    result = perplexity(model, ids, seq)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['tokens']} tokens: {result['nll_per_token']:.4f} nats/token, perplexity {result['perplexity']:.3f}"
        )
    return 0


def holdout_ids(corpus: str, tokenizer: str, fraction: float) -> list[int]:
    """The tail of a corpus that `fourd train` keeps out of training (same corpus, tokenizer and fraction)."""
    from fourd.data.dataset import SampleStream, prepare

    if not 0 < fraction < 0.5:
        raise FourdError(f"--holdout-fraction {fraction} must be in (0, 0.5), as the run's data.holdout_fraction")
    return SampleStream(prepare(corpus, tokenizer), seq_len=1, seed=0, holdout_fraction=fraction).holdout().tolist()


def _eos_ids(manifest: dict) -> list[int]:
    eos = (manifest.get("hf_config") or {}).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def load_model(ckpt: str):
    """The model of a checkpoint (or of a run directory's newest one), in float32 on the CPU, in eval
    mode; and the checkpoint's manifest."""
    from fourd.ckpt.store import load_model_checkpoint, read_manifest, resolve
    from fourd.model.llama import build_model

    path = resolve(ckpt)
    cfg, sd = load_model_checkpoint(path)
    if cfg.mlp != "swiglu":
        raise FourdError(f"{ckpt}: model.mlp = {cfg.mlp!r}; only Llama (swiglu) models run")
    model = build_model(cfg, seed=None)
    model.load_state_dict(sd)
    return model.eval(), read_manifest(path)


class KVCache(nn.Module):
    """Takes the place of `Attention.core` while generating: keeps the keys and values of every position
    seen so far, so that each new token costs one position's projections instead of the whole prefix."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k is None:  # the prompt: exactly the model's own causal attention
            self.k, self.v = k, v
            return self.core(q, k, v)
        self.k, self.v = torch.cat((self.k, k), dim=1), torch.cat((self.v, v), dim=1)
        new, total = q.shape[1], self.k.shape[1]
        # new query i sits at position total - new + i and sees every key up to there
        mask = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
        rep = q.shape[2] // k.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, self.k, self.v))
        if rep > 1:
            kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)


class ShiftedRope(nn.Module):
    """Takes the place of `Llama.rope`: the rotation rows of positions offset .. offset + seqlen - 1."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope
        self.offset = 0

    def forward(self, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.offset + seqlen
        return self.rope.cos[self.offset : end], self.rope.sin[self.offset : end]


class Cached:
    """Context manager: the model with a KV cache in every attention layer, restored afterwards.
    `step(ids)` feeds the next tokens and returns their logits [1, len(ids), vocab]."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        m = self.model
        self._saved = (m.rope, [layer.attention.core for layer in m.layers.values()])
        m.rope = ShiftedRope(m.rope)
        for layer in m.layers.values():
            layer.attention.core = KVCache(layer.attention.core)
        return self

    def __exit__(self, *exc):
        self.model.rope, cores = self._saved
        for layer, core in zip(self.model.layers.values(), cores):
            layer.attention.core = core

    @torch.no_grad()
    def step(self, ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([ids], dtype=torch.long))
        self.model.rope.offset += len(ids)
        return logits


def sample(logits: torch.Tensor, greedy: bool, top_p: float, temperature: float, gen: torch.Generator) -> int:
    """Nucleus sampling (Holtzman et al. 2020): draw from the smallest set of most likely tokens whose
    probability reaches top_p."""
    if greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    p, idx = probs.sort(descending=True)
    keep = (p.cumsum(0) - p) < top_p  # the mass before a token is short of top_p: it is in the nucleus
    return int(idx[torch.multinomial(p * keep, 1, generator=gen)])


def generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    greedy: bool = True,
    top_p: float = 1.0,
    temperature: float = 1.0,
    seed: int = 0,
    stop_ids=(),
) -> list[int]:
    """The generated ids (the prompt not included)."""
    cfg = model.cfg
    if not prompt:
        raise FourdError("the prompt is empty: give --prompt text or --prompt-ids")
    bad = [i for i in prompt if not 0 <= i < cfg.vocab]
    if bad:
        raise FourdError(f"prompt id {bad[0]} is outside the model's vocabulary 0..{cfg.vocab - 1}")
    if len(prompt) + max_new_tokens > cfg.max_seq:
        raise FourdError(
            f"prompt ({len(prompt)}) + --max-new-tokens ({max_new_tokens}) exceeds the model's "
            f"max_seq {cfg.max_seq}; shorten one of them"
        )
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    with Cached(model) as cache:
        logits = cache.step(prompt)
        while len(out) < max_new_tokens:
            nxt = sample(logits[0, -1], greedy, top_p, temperature, gen)
            out.append(nxt)
            if nxt in stop_ids:
                break
            logits = cache.step([nxt])
    return out


@torch.no_grad()
def perplexity(model, ids: list[int], seq: int, batch: int = 8) -> dict:
    """Mean negative log-likelihood per predicted token over non-overlapping windows of `seq` tokens,
    each token after the first predicted exactly once."""
    if seq < 1 or seq > model.cfg.max_seq:
        raise FourdError(f"--eval-seq {seq} must be in 1..{model.cfg.max_seq} (the model's max_seq)")
    if len(ids) < 2:
        raise FourdError("the evaluation text has fewer than 2 tokens; give a longer file")
    if max(ids) >= model.cfg.vocab:
        raise FourdError(
            f"token id {max(ids)} is outside the model's vocabulary; use the tokenizer it was trained with"
        )
    data = torch.tensor(ids, dtype=torch.long)
    starts = list(range(0, len(ids) - 1, seq))
    full = [s for s in starts if s + seq + 1 <= len(ids)]
    total, count = 0.0, 0
    for i in range(0, len(full), batch):
        x = torch.stack([data[s : s + seq + 1] for s in full[i : i + batch]])
        logits = model(x[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    if len(full) < len(starts):  # the shorter last window
        x = data[starts[-1] :][None]
        logits = model(x[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x.shape[1] - 1
    nll = total / count
    return {"tokens": count, "nll_per_token": nll, "perplexity": math.exp(nll)}
