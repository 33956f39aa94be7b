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
        """x / √(mean(x²) + eps) · weight, in FP32 (Zhang & Sennrich 2019)."""
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


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
    """cos and sin of the angles position · θ^(−2i/head_dim), i < head_dim / 2 (Su et al. 2021,
    RoFormer, eq. 15), computed in FP64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (a, b) = (x[2i], x[2i+1]) rotated to (a·cos − b·sin, a·sin + b·cos) (Su et al.
    2021, RoFormer, eq. 34); x: [batch, seq, heads, head_dim]; cos, sin: [seq, head_dim // 2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos_b, sin_b = cos[None, :, None, :], sin[None, :, None, :]
    return (
        torch.stack((even * cos_b - odd * sin_b, even * sin_b + odd * cos_b), dim=-1)
        .flatten(-2)
        .type_as(x)
    )


class CausalAttention(nn.Module):
    """softmax(q kᵀ / √d + causal mask) v on local heads; k and v carry the KV heads (GQA)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # q: [b, s, hq, d], k, v: [b, s, hkv, d]; SDPA's grouped-query path shares each KV head
        # without copies.
        query, key, value = (tensor.transpose(1, 2) for tensor in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)


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
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank sees only its own heads.
        query, key, value = (
            proj(x).view(batch, seq, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv)
        )
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        return self.wo(self.core(query, key, value).reshape(batch, seq, -1))


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
        hidden = x + self.attention(self.attention_norm(x), cos, sin)
        return hidden + self.feed_forward(self.ffn_norm(hidden))


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
        hidden = x  # a later pipeline stage takes hidden states
        if self.tok_embeddings is not None:
            hidden = self.tok_embeddings(x)
        cos, sin = self.rope(hidden.shape[1])
        for layer in self.layers.values():
            hidden = layer(hidden, cos, sin)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.output is not None:
            return self.output(hidden)
        return hidden

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """From the seed and each parameter's name alone, so every layout and pipeline stage starts
        from the same weights; each residual branch's output projection scaled by 1/√(2·layers)
        (GPT-2's depth scaling)."""
        std = 0.02
        depth_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            leaf = name  # the module that holds it: tok_embeddings.weight -> tok_embeddings
            if "." in name:
                leaf = name.rsplit(".", 2)[-2]
            scale = std
            if leaf == "tok_embeddings":
                scale = 1.0
            elif leaf in ("wo", "w2"):
                scale = depth_std
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * scale)


def build_model(
    cfg: ModelConfig, seed: int | None = 0, device: str | torch.device = "cpu"
) -> Llama:
    """The full model; on the meta device (no memory) when device == "meta"."""
    with torch.device(device):
        model = Llama(cfg)
    if seed is not None and str(device) != "meta":
        model.init_weights(seed)
    return model
