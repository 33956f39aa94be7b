"""Llama 3 in one file: RMSNorm, RoPE (θ = 500,000), grouped-query attention, SwiGLU, untied
embeddings. No parallelism lives here; its seams (docs/parallelism.md): `layers` a ModuleDict keyed
by the global layer index, and `tok_embeddings`, `norm`, `output` may be None (a pipeline stage);
`rope` holds the rows of the tokens the module sees; `Attention.core` is the attention kernel, a
module that context parallelism swaps.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from fourd.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


class Rope(nn.Module):
    """cos and sin of each position's angles, [positions, head_dim // 2]; pairs (x[2i], x[2i+1]) as
    in Meta's released weights (Hugging Face rotates halves; fourd.hf converts)."""

    def __init__(self, head_dim: int, max_seq: int, theta: float):
        super().__init__()
        cos, sin = rope_table(head_dim, torch.arange(max_seq), theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seqlen], self.sin[:seqlen]


def rope_table(
    head_dim: int, positions: torch.Tensor, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos, sin: [seq, head_dim // 2]."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


class CausalAttention(nn.Module):
    """softmax(q kᵀ / √d + causal mask) v on local heads; k and v carry the KV heads (GQA)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [b, s, hq, d], k, v: [b, s, hkv, d]; SDPA's grouped-query path shares each KV head
        # without copies.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(
            1, 2
        )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank sees only its own heads.
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(self.core(q, k, v).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.rope = Rope(cfg.head_dim, cfg.max_seq, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] → logits [b, s, vocab]; a pipeline stage passes hidden states
        through."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        cos, sin = self.rope(h.shape[1])
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """From the seed and each parameter's name alone, so every layout and pipeline stage starts
        from the same weights; each residual branch's output projection scaled by 1/√(2·layers)
        (GPT-2's depth scaling)."""
        std, depth_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 2)[-2] if name.count(".") else name
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            s = 1.0 if leaf == "tok_embeddings" else depth_std if leaf in ("wo", "w2") else std
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)


def build_model(
    cfg: ModelConfig, seed: int | None = 0, device: str | torch.device = "cpu"
) -> Llama:
    """The full model; on the meta device (no memory) when device == "meta"."""
    with torch.device(device):
        model = Llama(cfg)
    if seed is not None and str(device) != "meta":
        model.init_weights(seed)
    return model
