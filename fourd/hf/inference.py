"""Generation with a KV cache added from outside the model, nucleus sampling, and perplexity
(docs/hf.md)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fourd.ckpt import store
from fourd.model.llama import build_model


def load_model(ckpt) -> tuple[nn.Module, dict]:
    """The model of a checkpoint (or a run's newest) in float32 on the CPU in eval mode, and its
    manifest."""
    path = store.resolve(ckpt)
    cfg, state = store.load_model_checkpoint(path)
    model = build_model(cfg, seed=None)
    model.load_state_dict(state)
    return model.eval(), store.read_manifest(path)


class KVCache(nn.Module):
    """Takes the place of `Attention.core`: keeps the keys and values of every position seen so
    far."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.keys is None:  # the prompt: exactly the model's own causal attention
            self.keys, self.values = key, value
            return self.core(query, key, value)
        self.keys = torch.cat((self.keys, key), dim=1)
        self.values = torch.cat((self.values, value), dim=1)
        new = query.shape[1]
        total = self.keys.shape[1]
        # new query i sits at position total - new + i and sees every key up to there
        mask = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
        query_t, keys_t, values_t = (
            tensor.transpose(1, 2) for tensor in (query, self.keys, self.values)
        )
        return F.scaled_dot_product_attention(
            query_t, keys_t, values_t, attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)


class ShiftedRope(nn.Module):
    """Takes the place of `Llama.rope`: the rotation rows of positions offset .. offset + seqlen -
    1."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope
        self.offset = 0

    def forward(self, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.offset + seqlen
        return self.rope.cos[self.offset : end], self.rope.sin[self.offset : end]


class Cached:
    """The model with a KV cache in every attention layer, restored on exit; `step(ids)` returns
    their logits."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        model = self.model
        self._saved = (model.rope, [layer.attention.core for layer in model.layers.values()])
        model.rope = ShiftedRope(model.rope)
        for layer in model.layers.values():
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


def nucleus(
    logits: torch.Tensor, top_p: float, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, probabilities) of the nucleus (Holtzman et al. 2020), most likely first: the fewest
    most likely tokens of softmax(logits / temperature) holding top_p, their probabilities renormalized."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, idx = probs.sort(descending=True)
    # the mass before a token is short of top_p: it is in the nucleus
    keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
    return idx[keep], sorted_probs[keep] / sorted_probs[keep].sum()


def sample(
    logits: torch.Tensor, greedy: bool, top_p: float, temperature: float, gen: torch.Generator
) -> int:
    """The most likely token, or one drawn from the nucleus."""
    if greedy:
        return int(logits.argmax())
    ids, probs = nucleus(logits, top_p, temperature)
    return int(ids[torch.multinomial(probs, 1, generator=gen)])


def generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    greedy=True,
    top_p=1.0,
    temperature=1.0,
    seed=0,
    stop_ids=(),
):
    """The generated ids (the prompt not included); the caller checks ids and lengths against
    model.cfg."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    with Cached(model) as cache:
        logits = cache.step(prompt)
        while len(out) < max_new_tokens:
            next_id = sample(logits[0, -1], greedy, top_p, temperature, gen)
            out.append(next_id)
            if next_id in stop_ids:
                break
            logits = cache.step([next_id])
    return out


@torch.no_grad()
def perplexity(model, ids: list[int], seq: int, batch: int = 8) -> dict:
    """Mean NLL per token over non-overlapping windows of `seq` tokens: each but the first predicted
    once; perplexity = exp(mean NLL)."""
    data = torch.tensor(ids, dtype=torch.long)
    starts = list(range(0, len(ids) - 1, seq))
    full = [start for start in starts if start + seq + 1 <= len(ids)]
    groups = [
        torch.stack([data[start : start + seq + 1] for start in full[i : i + batch]])
        for i in range(0, len(full), batch)
    ]
    if len(full) < len(starts):  # the shorter last window
        groups.append(data[starts[-1] :][None])
    total, count = 0.0, 0
    for x in groups:
        logits = model(x[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    nll = total / count
    return {"tokens": count, "nll_per_token": nll, "perplexity": math.exp(nll)}
